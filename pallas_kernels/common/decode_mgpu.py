"""One-token GDN / KDA decode in Mosaic GPU: the state's tiles streamed through TMA copies.

Why (issue 19, BENCHMARKS.md "The decode kernels profiled"): the Triton decode holds each
``[16, Dk]`` f32 state tile in registers from its load to its store; 130 registers a thread cap
an SM at 12 warps, and ncu shows its warps mostly waiting on global loads (0.87 of copy). Here a
TMA copy brings a tile into shared memory without holding a register, and each program keeps
several tiles in flight while it updates another. Measured on an H200 (three processes, the
Triton decode beside it in each), it is level with the Triton decode, both 0.84-0.89 of copy at
64 rows and 0.89-0.92 at 256: occupancy is not what bounds either. Its own streaming ceiling
(``stream_only``: the same copies and stores, no update) is 0.86-0.93 of copy.

The kernel (one warpgroup a program, ``programs`` persistent programs, default one an SM):

- work item ``i`` = (row ``r``, head ``h``, value block ``vb`` of ``BV = 64`` rows of ``S^T``);
  program ``c`` takes items ``c, c + G, c + 2G, ...``;
- each item's copies, on one barrier of its buffer: ``pool[src, h, vb]`` (``[64, Dk]``, the
  pool's dtype), the row's ``q, k`` (and KDA's decay vector: ``[R, Dk]`` f32), the row's gate
  scalars (``[3, H]``: decay, beta, ``k . q``) and ``v`` (``[64]`` f32);
- the update in registers (WGMMA layout, the same algebra as ``delta_rule_gpu.decode_update``),
  the new tile written back over its buffer, then stored by TMA to ``dst`` and to each
  checkpoint at offset 1; ``o`` (f32, its own buffer an item) leaves by TMA too, the item's
  stores one commit group;
- before a buffer is refilled, the stores from it have read it: with ``lag`` 1 (default) the
  last item's group may still be reading (``wait_smem_to_gmem(1, wait_read_only=True)``), so
  the refill need not wait for the stores just issued; ``buffers - 1 - lag`` copies in flight.

The token's inputs that cost nothing next to the state (l2 norms, gates, ``k . q``) are
computed by XLA beforehand (:func:`gdn_inputs`, :func:`kda_inputs`: one fusion over
``[S, H, Dk]``, and ``o`` cast after: three launches a call). Made in the kernel instead (one
launch, as the Triton decode), they measured slower on an H200 (GDN 1-4 %, KDA 2.1x: its
per-channel decay's exp and softplus over each ``[64, Dk]`` tile), so that variant was removed
(BENCHMARKS.md, the Mosaic GPU decode).

Slot contract (DESIGN.md §3) as the Triton decode: ``src`` 0 reads zeros, ``dst`` 0 writes
nothing, checkpoints at offset 1 are written, padding rows write zeros to ``o``.

``interpret=True`` runs it in Pallas' GPU interpreter on a CPU host (the pool written through
an output and scattered into its slots: the interpreter takes no refs).

Not the default (level with the Triton decode, not faster): ``gdn.gpu.gdn_decode`` /
``kda.gpu.kda_decode`` run it when asked (``kernel="mgpu"``, or ``HYJAX_DECODE_KERNEL=mgpu`` for
a process: :data:`DECODE_DEFAULT`), the engine's decode cells through them; the engine has
served Kimi-Linear-48B (8 rows) and the 80B's layer shapes (64 rows) on it on an H200.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common.chunk_scan_mgpu import (
    SMEM_BYTES,
    GpuOps,
    InterpretOps,
    _plgpu,
    choose_mgpu,
    pool_kernel,
)
from pallas_kernels.common.delta_rule import l2norm, softplus
from pallas_kernels.common.slots import StateSlots

BV = 64  # rows of S^T a work item updates: a warpgroup's WGMMA-layout tile
# One program an SM with 5 tiles in shared memory, a buffer refilled while the last item's stores
# may still read theirs (LAG 1): 3 copies in flight beside the tile updated and the one stored.
# Measured on an H200 (BENCHMARKS.md, decode_mgpu, same process): 0.85-0.89 / 0.90-0.91 of
# copy at 64 / 256 rows; the first design (two programs an SM of 3 buffers, LAG 0: each refill
# waited for the item's stores just issued) 0.82-0.84 / 0.86-0.88.
BUFFERS = 5
PROGRAMS_PER_SM = 1
LAG = 1
LANES = 32  # f32 values in 128 bytes: a warpgroup's TMA copy moves a multiple of that
f32 = jnp.float32
# The one-token decode a GPU runs when not told (``kernel=None``): Triton's, which this one
# measured level with, not faster; HYJAX_DECODE_KERNEL=mgpu sets it for a process.
DECODE_DEFAULT = os.environ.get("HYJAX_DECODE_KERNEL", "triton")


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _scratch(rows, heads, dk, nvec, num_ckpt, pool_dtype, buffers, item=BV):
    """The kernel's scratch: the state tiles, ``o``, the rows' slots, the barriers (a buffer's:
    its tile and the item's three token copies; the slots'), then the token inputs'
    (``vectors``, ``gates``, ``v``: :func:`gdn_inputs`)."""
    plgpu = _plgpu()
    return (
        plgpu.SMEM((buffers, item, dk), pool_dtype),
        plgpu.SMEM((buffers, item), f32),
        plgpu.SMEM((3 + num_ckpt, _round_up(rows, LANES)), jnp.int32),
        plgpu.Barrier(num_arrivals=4, num_barriers=buffers),
        plgpu.Barrier(num_arrivals=1, num_barriers=1),
        plgpu.SMEM((buffers, nvec, dk), f32),
        plgpu.SMEM((buffers, 3, _round_up(heads, LANES)), f32),
        plgpu.SMEM((buffers, item), f32),
    )


def smem_bytes(scratch) -> int:
    """A program's shared memory: its scratch's buffers, and 1 KB for the barriers."""
    sizes = [
        math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in scratch if hasattr(x, "shape")
    ]
    return sum(sizes) + 1024


def tile_reason(pool_dtype, dk: int) -> str | None:
    """Why a pool's ``[64, Dk]`` state tiles cannot stream through a Mosaic GPU decode (this
    one or ``multi_decode_mgpu``), or None."""
    if jnp.dtype(pool_dtype) not in (jnp.dtype(f32), jnp.dtype(jnp.bfloat16)):
        return f"a {jnp.dtype(pool_dtype).name} pool"
    if dk not in (64, 128):
        return f"Dk={dk} (64 or 128: a [64, Dk] f32 tile in registers)"
    return None


def unsupported_reason(
    rows, heads, dk, dv, num_ckpt, pool_dtype, vectors=2, buffers=BUFFERS, item=BV
) -> str | None:
    """Why this kernel cannot take a decode (the Triton one then does), or None."""
    if why := tile_reason(pool_dtype, dk):
        return why
    if item % BV or dv % item:
        return f"Dv={dv} in items of {item} rows (multiples of {BV} dividing Dv)"
    need = smem_bytes(_scratch(rows, heads, dk, vectors, num_ckpt, pool_dtype, buffers, item))
    if need > SMEM_BYTES:
        return f"{rows} rows: shared memory {need} bytes over {SMEM_BYTES}"
    return None


def batch_reason(state, slots: StateSlots, vectors: int, **kw) -> str | None:
    """:func:`unsupported_reason` for a decode of ``slots``' rows on ``state``'s pool
    (``[num_slots, H, Dv, Dk]``); ``kw``: its options (``buffers``, ``item``)."""
    _, heads, dv, dk = state.shape
    num_ckpt = slots.ckpt_offsets.shape[1]
    return unsupported_reason(
        slots.num_rows, heads, dk, dv, num_ckpt, state.dtype, vectors, **kw
    )  # fmt: skip


def decode_is_mgpu(kernel, state, slots: StateSlots, vectors: int, interpret: bool) -> bool:
    """Whether a GDN (``vectors`` 2) / KDA (3) GPU decode runs this kernel: its ``kernel``
    (``"mgpu"``, ``"triton"``, or None: :data:`DECODE_DEFAULT`, Triton in interpret mode); see
    ``chunk_scan_mgpu.choose_mgpu``."""
    return choose_mgpu(
        "kernel", kernel, DECODE_DEFAULT, "HYJAX_DECODE_KERNEL", interpret,
        lambda: batch_reason(state, slots, vectors), "decode",
    )  # fmt: skip


def gdn_inputs(q, k, v, a, b, A_log, dt_bias):
    """GDN's token inputs for the kernel: ``vectors [S, Hk, 2, Dk]`` (q scaled and normalized,
    k normalized), ``gates [S, 3, Hv]`` (``exp(g)``, beta, ``k . q`` per value head) and ``v``
    in f32."""
    hk, dk = q.shape[1:]
    ratio = v.shape[1] // hk
    qn = l2norm(q.astype(f32)) * float(dk) ** -0.5
    kn = l2norm(k.astype(f32))
    g = -jnp.exp(A_log.astype(f32)) * softplus(a.astype(f32) + dt_bias.astype(f32))
    kq = jnp.repeat(jnp.sum(qn * kn, axis=-1), ratio, axis=1)  # value head h: key head h // r
    gates = jnp.stack([jnp.exp(g), jax.nn.sigmoid(b.astype(f32)), kq], axis=1)
    return jnp.stack([qn, kn], axis=2), gates, v.astype(f32)


def kda_inputs(q, k, v, g, b, A_log, dt_bias):
    """KDA's: ``vectors [S, H, 3, Dk]`` (q, k, and the decay ``exp(g)`` per key channel),
    ``gates [S, 3, H]`` (1, beta, ``k . q``) and ``v`` in f32."""
    dk = q.shape[2]
    qn = l2norm(q.astype(f32)) * float(dk) ** -0.5
    kn = l2norm(k.astype(f32))
    gl = -jnp.exp(A_log.astype(f32))[:, None] * softplus(g.astype(f32) + dt_bias.astype(f32))
    beta = jax.nn.sigmoid(b.astype(f32))
    gates = jnp.stack([jnp.ones_like(beta), beta, jnp.sum(qn * kn, axis=-1)], axis=1)
    return jnp.stack([qn, kn, jnp.exp(gl)], axis=2), gates, v.astype(f32)


def _slot_rows(slots: StateSlots) -> jax.Array:
    """i32 ``[3 + M, S padded]``: each row's source, destination, checkpoint slots at offset 1
    (each 0 where nothing is read or written, padding rows included) and whether it is live."""
    rows = slots.num_rows
    live = jnp.arange(rows) < slots.num_seqs
    ck = jnp.where(live[:, None] & (slots.ckpt_offsets == 1), slots.ckpt_slots, 0)
    cols = [jnp.where(live, slots.src_slot, 0), jnp.where(live, slots.dst_slot, 0)]
    meta = jnp.concatenate([jnp.stack(cols), ck.T, live[None].astype(jnp.int32)])
    return jnp.pad(meta.astype(jnp.int32), [(0, 0), (0, _round_up(rows, LANES) - rows)])


class _Token:
    """The token's inputs as :func:`gdn_inputs` / :func:`kda_inputs` made them (XLA): an item's
    copies into its buffer, and their values in the update."""

    def __init__(self, refs, scratch, ops, ratio, per_channel):
        self.vec_ref, self.gate_ref, self.v_ref = refs
        self.vec_s, self.gate_s, self.v_s = scratch
        self.ops, self.ratio, self.per_channel = ops, ratio, per_channel

    def issue(self, r, h, vb, b, bar):  # row r, head h, Dv block vb into buffer b
        plgpu = _plgpu()
        plgpu.copy_gmem_to_smem(self.vec_ref.at[r, h // self.ratio], self.vec_s.at[b], bar)
        plgpu.copy_gmem_to_smem(self.gate_ref.at[r], self.gate_s.at[b], bar)
        item = self.v_s.shape[1]
        plgpu.copy_gmem_to_smem(self.v_ref.at[r, h, pl.ds(vb * item, item)], self.v_s.at[b], bar)

    def token(self, b, r, h, shape):
        """``(decay, q, k, beta, k . q)``: the decay a scalar or ``shape``, q and k broadcast
        over ``shape``'s rows."""
        ops, vec_s, gate_s = self.ops, self.vec_s, self.gate_s

        def row(i):
            return jax.lax.broadcast_in_dim(ops.load_row_vector(vec_s.at[b, i]), shape, (1,))

        decay = row(2) if self.per_channel else gate_s[b, 0, h]
        return decay, row(0), row(1), gate_s[b, 1, h], gate_s[b, 2, h]

    def v(self, b, rs):  # v's rows ``rs`` of the item, a column vector
        return self.ops.load_col_vector(self.v_s.at[b, rs]).astype(f32)


def _body(refs, scratch, *, ops, programs, buffers, lag, ratio, per_channel, stream_only):
    plgpu = _plgpu()
    meta_ref, *token_refs, pool_in, pool_out, o_ref = refs
    tile_s, o_s, meta_s, bars, meta_bar, *token_s = scratch
    tok = _Token(token_refs, token_s, ops, ratio, per_channel)
    heads, dv = pool_in.shape[1], pool_in.shape[2]
    rows = o_ref.shape[0]
    item_rows = tile_s.shape[1]  # a multiple of BV: the update runs BV rows at a time
    nvb = dv // item_rows
    num_ckpt = meta_s.shape[0] - 3
    c = jax.lax.axis_index("c")
    n = (rows * heads * nvb - c + programs - 1) // programs  # this program's items

    plgpu.copy_gmem_to_smem(meta_ref, meta_s, meta_bar.at[0])
    plgpu.barrier_wait(meta_bar.at[0])

    def item(j):  # (row, head, Dv block) of this program's j-th item
        i = c + j * programs
        return i // (nvb * heads), (i // nvb) % heads, i % nvb

    def issue(j, b):
        r, h, vb = item(j)
        bar = bars.at[b]
        tile = pool_in.at[meta_s[0, r], h, pl.ds(vb * item_rows, item_rows)]
        plgpu.copy_gmem_to_smem(tile, tile_s.at[b], bar)
        tok.issue(r, h, vb, b, bar)

    for p in range(buffers - 1 - lag):

        @pl.when(p < n)
        def _(p=p):
            issue(p, p)

    def update(b, r, h, src, live):  # item's tile b: S^T decayed and updated in place, o
        decay, q, k, beta, kq = tok.token(b, r, h, (BV, tile_s.shape[2]))
        for part in range(item_rows // BV):  # BV rows of S^T at a time
            rs = pl.ds(part * BV, BV)
            s = ops.load(tile_s.at[b, rs], optimized=False).astype(f32)  # S^T [BV, Dk]
            s = jnp.where(src > 0, s, 0.0) * decay  # slot 0's tile was read, not used
            pred = jnp.sum(s * k, axis=1)  # S^T k [BV]
            sq = jnp.sum(s * q, axis=1)  # S^T q
            delta = beta * (tok.v(b, rs) - pred)
            o = jnp.where(live > 0, sq + delta * kq, 0.0)
            s = s + jax.lax.broadcast_in_dim(delta, s.shape, (0,)) * k
            tile_s.at[b, rs][...] = s.astype(tile_s.dtype)
            o_s.at[b, rs][...] = o.astype(o_s.dtype)

    def step(j, carry):
        b = j % buffers
        # item j - 1 - lag's stores (one commit group an item) have read the buffer refilled
        plgpu.wait_smem_to_gmem(lag, wait_read_only=True)
        ahead = j + buffers - 1 - lag

        @pl.when(ahead < n)
        def _():
            issue(ahead, ahead % buffers)

        r, h, vb = item(j)
        vs = pl.ds(vb * item_rows, item_rows)
        src, dst, live = meta_s[0, r], meta_s[1, r], meta_s[2 + num_ckpt, r]
        plgpu.barrier_wait(bars.at[b])
        if not stream_only:  # (the copies and stores alone: tiles stored as read)
            update(b, r, h, src, live)
        plgpu.commit_smem()

        def store(slot, to):  # (Pallas' interpreter takes no copy predicate)
            @pl.when(slot > 0)
            def _():
                plgpu.copy_smem_to_gmem(tile_s.at[b], to, commit_group=False)

        store(dst, pool_out.at[dst, h, vs])
        for m in range(num_ckpt):
            ck = meta_s[2 + m, r]
            store(ck, pool_out.at[ck, h, vs])
        plgpu.copy_smem_to_gmem(o_s.at[b], o_ref.at[r, h, vs], commit_group=False)
        plgpu.commit_smem_to_gmem_group()
        return carry

    jax.lax.fori_loop(0, n, step, 0)
    plgpu.wait_smem_to_gmem(0)


def _num_sms() -> int:
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def program_count(programs: int | None, items: int, per_sm: int, interpret: bool) -> int:
    """A persistent decode's programs: ``programs``, or ``per_sm`` an SM (4 in the
    interpreter), never more than its items."""
    if programs is None:
        programs = 4 if interpret else per_sm * _num_sms()
    return max(1, min(programs, items))


def padded_inputs(vectors, gates, v, heads: int, tokens_after: int = 0):
    """The token inputs in f32 as the kernels copy them: ``gates`` padded to a multiple of
    ``LANES`` heads (a TMA copy of 128-byte multiples), and each array by ``tokens_after``
    zero rows (a k-token window never leaves them)."""
    rows = [(0, tokens_after)]
    hp = _round_up(heads, LANES)
    gates = jnp.pad(gates.astype(f32), [*rows, (0, 0), (0, hp - heads)])
    vectors = jnp.pad(vectors.astype(f32), rows + [(0, 0)] * (vectors.ndim - 1))
    return vectors, gates, jnp.pad(v.astype(f32), rows + [(0, 0)] * (v.ndim - 1))


def decode_mgpu(
    token_inputs: tuple[jax.Array, ...],  # gdn_inputs' / kda_inputs' (vectors, gates, v)
    state: jax.Array,  # f32 | bf16[num_slots, H, Dv, Dk]  donated: updated in place
    slots: StateSlots,
    *,
    out_dtype,
    name: str,
    programs: int | None = None,
    buffers: int = BUFFERS,
    item_rows: int = BV,
    stream_only: bool = False,
    lag: int = LAG,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The kernel on its token inputs: :func:`gdn_inputs` / :func:`kda_inputs`' (XLA made the
    norms and gates). Returns ``(o [S, H, Dv], state)``, ``o`` in ``out_dtype``.
    ``stream_only`` (benchmarks only) moves the bytes without the update: each tile stored as
    read (``src`` to ``dst``), ``o`` unwritten; the design's streaming ceiling. ``item_rows``:
    rows of ``S^T`` a work item copies at once (``BV`` or a multiple, updated ``BV`` at a
    time). ``lag``: items whose stores may still be reading their buffers when one is refilled
    (0 or 1; ``buffers - 1 - lag`` copies in flight)."""
    plgpu = _plgpu()
    if lag not in (0, 1) or buffers < 2 + lag:
        raise ValueError(f"lag={lag} with {buffers} buffers (lag 0 or 1, buffers >= 2 + lag)")
    _, heads, dv, dk = state.shape
    rows = slots.num_rows
    num_ckpt = slots.ckpt_offsets.shape[1]
    vectors, gates, v = token_inputs
    hk, nvec = vectors.shape[1], vectors.shape[2]
    why = unsupported_reason(rows, heads, dk, dv, num_ckpt, state.dtype, nvec, buffers, item_rows)
    if why:
        raise ValueError(f"the Mosaic GPU decode cannot take this batch: {why}")
    token_inputs = padded_inputs(vectors, gates, v, heads)
    meta = _slot_rows(slots)
    programs = program_count(programs, rows * heads * (dv // item_rows), PROGRAMS_PER_SM, interpret)
    scratch = _scratch(rows, heads, dk, nvec, num_ckpt, state.dtype, buffers, item_rows)
    body = functools.partial(
        _body,
        ops=InterpretOps if interpret else GpuOps,
        programs=programs,
        buffers=buffers,
        lag=lag,
        ratio=heads // hk,
        per_channel=nvec == 3,
        stream_only=stream_only,
    )
    mesh = plgpu.Mesh(grid=(programs,), grid_names=("c",))
    o_type = jax.ShapeDtypeStruct((rows, heads, dv), f32)
    written = meta[1 : 2 + num_ckpt, :rows]  # dst, then each checkpoint slot (0: none)
    o, state = pool_kernel(
        body, scratch, mesh, (meta, *token_inputs), state, o_type, written,
        name=f"{name}_mgpu", interpret=interpret,
    )  # fmt: skip
    return o.astype(out_dtype), state


def _family(inputs, name: str):
    def decode(q, k, v, gate, b, A_log, dt_bias, state, slots, **kw):
        acts = inputs(q, k, v, gate, b, A_log, dt_bias)
        return decode_mgpu(acts, state, slots, out_dtype=v.dtype, name=name, **kw)

    return decode


# ``gdn.gpu.gdn_decode``'s / ``kda.gpu.kda_decode``'s arguments and results, on this kernel
# (``gate``: GDN's ``a [S, Hv]``, KDA's raw ``g [S, H, Dk]``).
gdn_decode_mgpu = _family(gdn_inputs, "gdn_decode")
kda_decode_mgpu = _family(kda_inputs, "kda_decode")
