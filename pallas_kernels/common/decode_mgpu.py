"""One-token GDN / KDA decode in Mosaic GPU: the state's tiles streamed through TMA copies.

Why (issue 19, BENCHMARKS.md "The decode kernels profiled"): the Triton decode holds each
``[16, Dk]`` f32 state tile in registers from its load to its store; 130 registers a thread cap
an SM at 12 warps, and ncu shows its warps mostly waiting on global loads (0.87 of copy). Here a
TMA copy brings a tile into shared memory without holding a register, and each program keeps
``BUFFERS - 1`` tiles in flight while it updates another. Measured on an H200, that did not
move GDN's figure (level with Triton): occupancy is not what bounds it. KDA gained 3.5-4.4 %.

The kernel (one warpgroup a program, ``programs`` persistent programs, default two an SM):

- work item ``i`` = (row ``r``, head ``h``, value block ``vb`` of ``BV = 64`` rows of ``S^T``);
  program ``c`` takes items ``c, c + G, c + 2G, ...``;
- each item's copies, on one barrier of its buffer: ``pool[src, h, vb]`` (``[64, Dk]``, the
  pool's dtype), the row's ``q, k`` (and KDA's decay vector: ``[R, Dk]`` f32), the row's gate
  scalars (``[3, H]``: decay, beta, ``k . q``) and ``v`` (``[64]`` f32);
- the update in registers (WGMMA layout, the same algebra as ``delta_rule_gpu.decode_update``),
  the new tile written back over its buffer, then stored by TMA to ``dst`` and to each
  checkpoint at offset 1; ``o`` (f32) leaves by TMA too. Before a buffer is refilled, the stores
  from it have read it (``wait_smem_to_gmem(0, wait_read_only=True)``).

The token's inputs that cost nothing next to the state (l2 norms, gates, ``k . q``) are
computed by XLA beforehand (:func:`gdn_inputs`, :func:`kda_inputs`: one fusion over
``[S, H, Dk]``, and ``o`` cast after: three launches a call), or with ``fused=True`` in the
kernel from the layer's own activations (:class:`_Raw`: one launch, as the Triton decode; its
whole-array copies of the gates need ``heads`` a multiple of 32, e.g. the 80B and Kimi on one
card). The fused path has not yet run on a GPU.

Slot contract (DESIGN.md §3) as the Triton decode: ``src`` 0 reads zeros, ``dst`` 0 writes
nothing, checkpoints at offset 1 are written, padding rows write zeros to ``o``.

``interpret=True`` runs it in Pallas' GPU interpreter on a CPU host (the pool written through
an output and scattered into its slots: the interpreter takes no refs).

Not the default yet: ``gdn.gpu.gdn_decode`` / ``kda.gpu.kda_decode`` run it when asked
(``kernel="mgpu"``, or ``HYJAX_DECODE_KERNEL=mgpu`` for a process: :data:`DECODE_DEFAULT`), the
engine's decode cells through them. Measured on an H200 (BENCHMARKS.md): exact, level with the
Triton decode for GDN, 3.5-4.4 % faster for KDA.
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
BUFFERS = 3  # tiles a program has in shared memory: BUFFERS - 1 in flight beside the one updated
PROGRAMS_PER_SM = 2
LANES = 32  # f32 values in 128 bytes: a warpgroup's TMA copy moves a multiple of that
f32 = jnp.float32
# The one-token decode a GPU runs when not told (``kernel=None``): Triton's until this one has
# run in the engine on a GPU; HYJAX_DECODE_KERNEL=mgpu sets it for a process.
DECODE_DEFAULT = os.environ.get("HYJAX_DECODE_KERNEL", "triton")
# Whether it makes the token's norms and gates itself (``fused``) when not told, where the
# batch allows: off until the fused path has run on a GPU; HYJAX_DECODE_FUSED=1 for a process.
DECODE_FUSED = os.environ.get("HYJAX_DECODE_FUSED", "0") == "1"


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _scratch(rows, heads, dk, nvec, num_ckpt, pool_dtype, out_dtype, buffers, fused, item=BV):
    """The kernel's scratch: the state tiles, ``o``, the rows' slots, the barriers (a buffer's,
    the preload's), then the token inputs' (:class:`_Prepared` or :class:`_Raw`)."""
    plgpu = _plgpu()
    inputs = _Raw if fused else _Prepared
    copies, preloads = inputs.counts(nvec == 3)
    return (
        plgpu.SMEM((buffers, item, dk), pool_dtype),
        plgpu.SMEM((item,), out_dtype if fused else f32),
        plgpu.SMEM((3 + num_ckpt, _round_up(rows, LANES)), jnp.int32),
        plgpu.Barrier(num_arrivals=1 + copies, num_barriers=buffers),
        plgpu.Barrier(num_arrivals=1 + preloads, num_barriers=1),
        *inputs.scratch(plgpu, buffers, rows, heads, nvec, dk, out_dtype, item),
    )


def smem_bytes(scratch) -> int:
    """A program's shared memory: its scratch's buffers, and 1 KB for the barriers."""
    sizes = [
        math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in scratch if hasattr(x, "shape")
    ]
    return sum(sizes) + 1024


def unsupported_reason(
    rows, heads, dk, dv, num_ckpt, pool_dtype, vectors=2, buffers=BUFFERS, fused=False,
    act_dtype=jnp.bfloat16, item=BV,
) -> str | None:  # fmt: skip
    """Why this kernel cannot take a decode (the Triton one then does), or None. ``fused``:
    the token inputs as the layer has them (:class:`_Raw`), whose whole-array copies need
    ``rows * heads`` activations and ``heads`` f32 parameters in multiples of 128 bytes."""
    if jnp.dtype(pool_dtype) not in (jnp.dtype(f32), jnp.dtype(jnp.bfloat16)):
        return f"a {jnp.dtype(pool_dtype).name} pool"
    if dk not in (64, 128):
        return f"Dk={dk} (64 or 128: a [64, Dk] f32 tile in registers)"
    if item % BV or dv % item:
        return f"Dv={dv} in items of {item} rows (multiples of {BV} dividing Dv)"
    if fused:
        if (rows * heads * jnp.dtype(act_dtype).itemsize) % 128 or (heads * 4) % 128:
            return f"{rows} rows x {heads} heads (whole copies of a multiple of 128 bytes)"
    scratch = _scratch(
        rows, heads, dk, vectors, num_ckpt, pool_dtype, act_dtype, buffers, fused, item
    )
    need = smem_bytes(scratch)
    if need > SMEM_BYTES:
        return f"{rows} rows: shared memory {need} bytes over {SMEM_BYTES}"
    return None


def batch_reason(state, slots: StateSlots, vectors: int, **kw) -> str | None:
    """:func:`unsupported_reason` for a decode of ``slots``' rows on ``state``'s pool
    (``[num_slots, H, Dv, Dk]``); ``kw``: its options (``fused``, ``act_dtype``, ...)."""
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


def _softplus(x):
    """``log1p(exp(x))`` from ``log`` alone (Mosaic GPU lowers no ``log1p``): ``log(u) * y /
    (u - 1)`` with ``u = 1 + y`` corrects the rounding of ``u`` (Goldberg's trick)."""
    y = jnp.exp(jnp.minimum(x, 20.0))
    u = 1.0 + y
    lp = jnp.where(u == 1.0, y, jnp.log(u) * y / jnp.where(u == 1.0, 1.0, u - 1.0))
    return jnp.where(x > 20.0, x, lp)


def _l2norm_rows(x):  # each row of a [M, N] WGMMA array over its N columns
    ss = jnp.sum(x * x, axis=1)
    return x * jax.lax.broadcast_in_dim(jax.lax.rsqrt(ss + 1e-6), x.shape, (0,))


class _Prepared:
    """The token's inputs as :func:`gdn_inputs` / :func:`kda_inputs` made them (XLA)."""

    def __init__(self, refs, scratch, ops, ratio, per_channel):
        self.vec_ref, self.gate_ref, self.v_ref = refs
        self.vec_s, self.gate_s, self.v_s = scratch
        self.ops, self.ratio, self.per_channel = ops, ratio, per_channel

    @staticmethod
    def scratch(plgpu, buffers, rows, heads, nvec, dk, out_dtype, item):
        hp = _round_up(heads, LANES)
        return (plgpu.SMEM((buffers, nvec, dk), f32), plgpu.SMEM((buffers, 3, hp), f32),
                plgpu.SMEM((buffers, item), f32))  # fmt: skip

    @staticmethod
    def counts(per_channel):  # a buffer's copies besides the state tile; whole-array copies
        return 3, 0

    def preload(self, bar):
        pass

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


class _Raw:
    """The layer's activations and gate parameters as they are (``fused`` inputs): norms,
    gates and ``k . q`` in the kernel. GDN: ``q, k [S, Hk, Dk]``, ``v``, ``a, b [S, H]``,
    ``A_log, dt_bias [H]``; KDA: ``q, k, g [S, H, Dk]``, ``v``, ``b``, ``A_log [H]``,
    ``dt_bias [H, Dk]``. ``a`` / ``b`` and the ``[H]`` parameters are copied whole, once a
    program."""

    def __init__(self, refs, scratch, ops, ratio, per_channel):
        self.refs, self.s, self.ops = refs, scratch, ops
        self.ratio, self.per_channel = ratio, per_channel

    @staticmethod
    def counts(per_channel):
        return (5, 2) if per_channel else (3, 4)

    @staticmethod
    def scratch(plgpu, buffers, rows, heads, nvec, dk, out_dtype, item):
        act = out_dtype  # the activations' dtype
        per_buffer = [plgpu.SMEM((buffers, dk), act), plgpu.SMEM((buffers, dk), act),
                      plgpu.SMEM((buffers, item), act)]  # fmt: skip
        if nvec == 3:  # KDA: g and dt_bias a head
            per_buffer += [plgpu.SMEM((buffers, dk), act), plgpu.SMEM((buffers, dk), f32)]
            whole = [plgpu.SMEM((rows, heads), act), plgpu.SMEM((heads,), f32)]
        else:  # GDN: a, b, A_log, dt_bias
            whole = [plgpu.SMEM((rows, heads), act), plgpu.SMEM((rows, heads), act),
                     plgpu.SMEM((heads,), f32), plgpu.SMEM((heads,), f32)]  # fmt: skip
        return (*per_buffer, *whole)

    def preload(self, bar):
        plgpu = _plgpu()
        if self.per_channel:
            (*_, b_ref, alog_ref, _), (*_, b_s, alog_s) = self.refs, self.s
            pairs = [(b_ref, b_s), (alog_ref, alog_s)]
        else:
            pairs = list(zip(self.refs[3:], self.s[3:], strict=True))
        for ref, smem in pairs:
            plgpu.copy_gmem_to_smem(ref, smem, bar)

    def issue(self, r, h, vb, b, bar):  # row r, head h, Dv block vb into buffer b
        plgpu = _plgpu()
        q_ref, k_ref, v_ref = self.refs[:3]
        q_s, k_s, v_s = self.s[:3]
        hk = h // self.ratio
        plgpu.copy_gmem_to_smem(q_ref.at[r, hk], q_s.at[b], bar)
        plgpu.copy_gmem_to_smem(k_ref.at[r, hk], k_s.at[b], bar)
        item = v_s.shape[1]
        plgpu.copy_gmem_to_smem(v_ref.at[r, h, pl.ds(vb * item, item)], v_s.at[b], bar)
        if self.per_channel:
            g_ref, dtb_ref = self.refs[3], self.refs[6]
            plgpu.copy_gmem_to_smem(g_ref.at[r, h], self.s[3].at[b], bar)
            plgpu.copy_gmem_to_smem(dtb_ref.at[h], self.s[4].at[b], bar)

    def token(self, b, r, h, shape):
        ops = self.ops
        q_s, k_s, v_s = self.s[:3]

        def row(ref):
            vec = ops.load_row_vector(ref).astype(f32)
            return jax.lax.broadcast_in_dim(vec, shape, (1,))

        q = _l2norm_rows(row(q_s.at[b])) * float(shape[1]) ** -0.5
        k = _l2norm_rows(row(k_s.at[b]))
        if self.per_channel:
            b_s, alog_s = self.s[5], self.s[6]
            x = row(self.s[3].at[b]) + row(self.s[4].at[b])  # g + dt_bias[h]: [Dk] a column
            decay = jnp.exp(-jnp.exp(alog_s[h]) * _softplus(x))
        else:
            a_s, b_s, alog_s, dtb_s = self.s[3:]
            x = a_s[r, h].astype(f32) + dtb_s[h]
            decay = jnp.exp(-jnp.exp(alog_s[h]) * _softplus(x))
        beta = jax.nn.sigmoid(b_s[r, h].astype(f32))
        return decay, q, k, beta, jnp.sum(q * k, axis=1)

    def v(self, b, rs):
        return self.ops.load_col_vector(self.s[2].at[b, rs]).astype(f32)


def _body(refs, scratch, *, ops, programs, buffers, ratio, per_channel, inputs, stream_only):
    plgpu = _plgpu()
    meta_ref, *token_refs, pool_in, pool_out, o_ref = refs
    tile_s, o_s, meta_s, bars, meta_bar, *token_s = scratch
    tok = inputs(token_refs, token_s, ops, ratio, per_channel)
    heads, dv = pool_in.shape[1], pool_in.shape[2]
    rows = o_ref.shape[0]
    item_rows = tile_s.shape[1]  # a multiple of BV: the update runs BV rows at a time
    nvb = dv // item_rows
    num_ckpt = meta_s.shape[0] - 3
    c = jax.lax.axis_index("c")
    n = (rows * heads * nvb - c + programs - 1) // programs  # this program's items

    plgpu.copy_gmem_to_smem(meta_ref, meta_s, meta_bar.at[0])
    tok.preload(meta_bar.at[0])
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

    for p in range(buffers - 1):

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
            o_s.at[rs][...] = o.astype(o_s.dtype)

    def step(j, carry):
        b = j % buffers
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # item j - 1's stores have read

        @pl.when(j + buffers - 1 < n)
        def _():
            issue(j + buffers - 1, (j + buffers - 1) % buffers)

        r, h, vb = item(j)
        vs = pl.ds(vb * item_rows, item_rows)
        src, dst, live = meta_s[0, r], meta_s[1, r], meta_s[2 + num_ckpt, r]
        plgpu.barrier_wait(bars.at[b])
        if not stream_only:  # (the copies and stores alone: tiles stored as read)
            update(b, r, h, src, live)
        plgpu.commit_smem()

        @pl.when(dst > 0)
        def _():
            plgpu.copy_smem_to_gmem(tile_s.at[b], pool_out.at[dst, h, vs])

        for m in range(num_ckpt):
            ck = meta_s[2 + m, r]

            @pl.when(ck > 0)
            def _(ck=ck):
                plgpu.copy_smem_to_gmem(tile_s.at[b], pool_out.at[ck, h, vs])

        plgpu.copy_smem_to_gmem(o_s, o_ref.at[r, h, vs])
        return carry

    jax.lax.fori_loop(0, n, step, 0)
    plgpu.wait_smem_to_gmem(0)


def _num_sms() -> int:
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def decode_mgpu(
    token_inputs: tuple[jax.Array, ...],  # _Prepared's or _Raw's arrays (their docstrings)
    state: jax.Array,  # f32 | bf16[num_slots, H, Dv, Dk]  donated: updated in place
    slots: StateSlots,
    *,
    out_dtype,
    name: str,
    fused: bool = False,
    programs: int | None = None,
    buffers: int = BUFFERS,
    item_rows: int = BV,
    stream_only: bool = False,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The kernel on its token inputs: :func:`gdn_inputs` / :func:`kda_inputs`' (XLA made the
    norms and gates), or with ``fused`` the layer's own (:class:`_Raw`: the kernel makes them,
    and writes ``o`` in ``out_dtype`` itself). Returns ``(o [S, H, Dv], state)``.
    ``stream_only`` (benchmarks only) moves the bytes without the update: each tile stored as
    read (``src`` to ``dst``), ``o`` unwritten; the design's streaming ceiling. ``item_rows``:
    rows of ``S^T`` a work item copies at once (``BV`` or a multiple, updated ``BV`` at a
    time)."""
    plgpu = _plgpu()
    _, heads, dv, dk = state.shape
    rows = slots.num_rows
    num_ckpt = slots.ckpt_offsets.shape[1]
    if fused:
        q, v = token_inputs[0], token_inputs[2]
        nvec, hk, act = (3 if token_inputs[3].ndim == 3 else 2), q.shape[1], v.dtype
    else:
        q, act = token_inputs[0], out_dtype
        hk, nvec = q.shape[1], q.shape[2]
    why = unsupported_reason(
        rows, heads, dk, dv, num_ckpt, state.dtype, nvec, buffers, fused, act, item_rows
    )  # fmt: skip
    if why:
        raise ValueError(f"the Mosaic GPU decode cannot take this batch: {why}")
    if fused and jnp.dtype(out_dtype) != jnp.dtype(act):
        raise ValueError(f"fused: o is written in the activations' dtype {act}, not {out_dtype}")
    if not fused:
        vectors, gates, v = token_inputs
        hp = _round_up(heads, LANES)
        gates = jnp.pad(gates.astype(f32), [(0, 0), (0, 0), (0, hp - heads)])
        token_inputs = (vectors.astype(f32), gates, v.astype(f32))
    meta = _slot_rows(slots)
    items = rows * heads * (dv // item_rows)
    if programs is None:
        programs = 4 if interpret else PROGRAMS_PER_SM * _num_sms()
    programs = max(1, min(programs, items))
    scratch = _scratch(rows, heads, dk, nvec, num_ckpt, state.dtype, act, buffers, fused, item_rows)
    body = functools.partial(
        _body,
        ops=InterpretOps if interpret else GpuOps,
        programs=programs,
        buffers=buffers,
        ratio=heads // hk,
        per_channel=nvec == 3,
        inputs=_Raw if fused else _Prepared,
        stream_only=stream_only,
    )
    mesh = plgpu.Mesh(grid=(programs,), grid_names=("c",))
    o_type = jax.ShapeDtypeStruct((rows, heads, dv), out_dtype if fused else f32)
    written = meta[1 : 2 + num_ckpt, :rows]  # dst, then each checkpoint slot (0: none)
    o, state = pool_kernel(
        body, scratch, mesh, (meta, *token_inputs), state, o_type, written,
        name=f"{name}_mgpu", interpret=interpret,
    )  # fmt: skip
    return o.astype(out_dtype), state


def _family(inputs, name: str):
    def decode(q, k, v, gate, b, A_log, dt_bias, state, slots, *, fused=None, **kw):
        if fused is None:  # HYJAX_DECODE_FUSED=1: where the batch allows it
            nvec = 3 if gate.ndim == 3 else 2
            fused = DECODE_FUSED and not batch_reason(
                state, slots, nvec, fused=True, act_dtype=v.dtype
            )
        if fused:
            acts = (q, k, v, gate, b, A_log.astype(f32), dt_bias.astype(f32))
        else:
            acts = inputs(q, k, v, gate, b, A_log, dt_bias)
        return decode_mgpu(acts, state, slots, out_dtype=v.dtype, name=name, fused=fused, **kw)

    return decode


# ``gdn.gpu.gdn_decode``'s / ``kda.gpu.kda_decode``'s arguments and results, on this kernel
# (``gate``: GDN's ``a [S, Hv]``, KDA's raw ``g [S, H, Dk]``); ``fused`` None: DECODE_FUSED
# where the batch allows it.
gdn_decode_mgpu = _family(gdn_inputs, "gdn_decode")
kda_decode_mgpu = _family(kda_inputs, "kda_decode")
