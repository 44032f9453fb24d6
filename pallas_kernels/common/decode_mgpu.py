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
computed by XLA beforehand (:func:`gdn_inputs`, :func:`kda_inputs`): one fusion over
``[S, H, Dk]``. Slot contract (DESIGN.md §3) as the Triton decode: ``src`` 0 reads zeros,
``dst`` 0 writes nothing, checkpoints at offset 1 are written, padding rows write zeros to ``o``.

``interpret=True`` runs it in Pallas' GPU interpreter on a CPU host (the pool written through
an output and scattered into its slots: the interpreter takes no refs).

Not the default yet: ``gdn.gpu.gdn_decode`` / ``kda.gpu.kda_decode`` run it when asked
(``kernel="mgpu"``, or ``HYJAX_DECODE_KERNEL=mgpu`` for a process: :data:`DECODE_DEFAULT`), the
engine's decode cells through them. Measured on an H200 (BENCHMARKS.md): exact, level with the
Triton decode for GDN, 3.5-4.4 % faster for KDA.
"""

from __future__ import annotations

import functools
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


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def smem_bytes(
    rows: int, heads: int, dk: int, vectors: int, num_ckpt: int, pool_dtype, buffers=BUFFERS
) -> int:
    """A program's shared memory: its buffers (a state tile, the token's vectors, gates, v),
    the output vector and the rows' slots."""
    per_buffer = (
        BV * dk * jnp.dtype(pool_dtype).itemsize
        + vectors * dk * 4
        + 3 * _round_up(heads, LANES) * 4
        + BV * 4
    )
    return buffers * per_buffer + BV * 4 + (3 + num_ckpt) * _round_up(rows, LANES) * 4 + 1024


def unsupported_reason(
    rows, heads, dk, dv, num_ckpt, pool_dtype, vectors=2, buffers=BUFFERS
) -> str | None:
    """Why this kernel cannot take a decode (the Triton one then does), or None."""
    if jnp.dtype(pool_dtype) not in (jnp.dtype(f32), jnp.dtype(jnp.bfloat16)):
        return f"a {jnp.dtype(pool_dtype).name} pool"
    if dk not in (64, 128):
        return f"Dk={dk} (64 or 128: a [64, Dk] f32 tile in registers)"
    if dv % BV:
        return f"Dv={dv} (a multiple of {BV})"
    need = smem_bytes(rows, heads, dk, vectors, num_ckpt, pool_dtype, buffers)
    if need > SMEM_BYTES:
        return f"{rows} rows: shared memory {need} bytes over {SMEM_BYTES}"
    return None


def decode_is_mgpu(kernel, rows, heads, dk, dv, num_ckpt, pool_dtype, vectors, interpret) -> bool:
    """Whether a GDN / KDA GPU decode runs this kernel: its ``kernel`` (``"mgpu"``,
    ``"triton"``, or None: :data:`DECODE_DEFAULT`, Triton in interpret mode); see
    ``chunk_scan_mgpu.choose_mgpu``."""
    return choose_mgpu(
        "kernel", kernel, DECODE_DEFAULT, "HYJAX_DECODE_KERNEL", interpret,
        lambda: unsupported_reason(rows, heads, dk, dv, num_ckpt, pool_dtype, vectors), "decode",
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


def _body(refs, scratch, *, ops, programs, buffers, ratio, per_channel, stream_only=False):
    plgpu = _plgpu()
    meta_ref, vec_ref, gate_ref, v_ref, pool_in, pool_out, o_ref = refs
    tile_s, vec_s, gate_s, v_s, o_s, meta_s, bars, meta_bar = scratch
    heads, dv = pool_in.shape[1], pool_in.shape[2]
    rows = v_ref.shape[0]
    nvb = dv // BV
    num_ckpt = meta_s.shape[0] - 3
    c = jax.lax.axis_index("c")
    n = (rows * heads * nvb - c + programs - 1) // programs  # this program's items

    plgpu.copy_gmem_to_smem(meta_ref, meta_s, meta_bar.at[0])
    plgpu.barrier_wait(meta_bar.at[0])

    def item(j):  # (row, head, Dv rows) of this program's j-th item
        i = c + j * programs
        return i // (nvb * heads), (i // nvb) % heads, pl.ds((i % nvb) * BV, BV)

    def issue(j, b):
        r, h, vs = item(j)
        bar = bars.at[b]
        plgpu.copy_gmem_to_smem(pool_in.at[meta_s[0, r], h, vs], tile_s.at[b], bar)
        plgpu.copy_gmem_to_smem(vec_ref.at[r, h // ratio], vec_s.at[b], bar)
        plgpu.copy_gmem_to_smem(gate_ref.at[r], gate_s.at[b], bar)
        plgpu.copy_gmem_to_smem(v_ref.at[r, h, vs], v_s.at[b], bar)

    for p in range(buffers - 1):

        @pl.when(p < n)
        def _(p=p):
            issue(p, p)

    def update(b, h, src, live):  # item's tile b: S^T decayed and updated in place, o
        s = ops.load(tile_s.at[b], optimized=False).astype(f32)  # S^T [BV, Dk]
        if per_channel:
            decay = jax.lax.broadcast_in_dim(ops.load_row_vector(vec_s.at[b, 2]), s.shape, (1,))
        else:
            decay = gate_s[b, 0, h]
        s = jnp.where(src > 0, s, 0.0) * decay  # slot 0's tile was read, not used
        q = jax.lax.broadcast_in_dim(ops.load_row_vector(vec_s.at[b, 0]), s.shape, (1,))
        k = jax.lax.broadcast_in_dim(ops.load_row_vector(vec_s.at[b, 1]), s.shape, (1,))
        pred = jnp.sum(s * k, axis=1)  # S^T k [BV]
        sq = jnp.sum(s * q, axis=1)  # S^T q
        delta = gate_s[b, 1, h] * (ops.load_col_vector(v_s.at[b]) - pred)
        o = jnp.where(live > 0, sq + delta * gate_s[b, 2, h], 0.0)
        s = s + jax.lax.broadcast_in_dim(delta, s.shape, (0,)) * k
        tile_s[b] = s.astype(tile_s.dtype)
        o_s[...] = o

    def step(j, carry):
        b = j % buffers
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # item j - 1's stores have read

        @pl.when(j + buffers - 1 < n)
        def _():
            issue(j + buffers - 1, (j + buffers - 1) % buffers)

        r, h, vs = item(j)
        src, dst, live = meta_s[0, r], meta_s[1, r], meta_s[2 + num_ckpt, r]
        plgpu.barrier_wait(bars.at[b])
        if not stream_only:  # (the copies and stores alone: tiles stored as read)
            update(b, h, src, live)
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
    vectors: jax.Array,  # f32[S, Hk, R, Dk]  q, k (and KDA's decay vector)
    gates: jax.Array,  # f32[S, 3, H]  decay (GDN; 1 for KDA), beta, k . q
    v: jax.Array,  # f32[S, H, Dv]
    state: jax.Array,  # f32 | bf16[num_slots, H, Dv, Dk]  donated: updated in place
    slots: StateSlots,
    *,
    out_dtype,
    name: str,
    programs: int | None = None,
    buffers: int = BUFFERS,
    stream_only: bool = False,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The kernel on the token inputs of :func:`gdn_inputs` / :func:`kda_inputs`. Returns
    ``(o [S, H, Dv], state)``. ``stream_only`` (benchmarks only) moves the bytes without the
    update: each tile stored as read (``src`` to ``dst``), ``o`` unwritten; the design's
    streaming ceiling."""
    plgpu = _plgpu()
    rows, heads, dv = v.shape
    hk, nvec, dk = vectors.shape[1:]
    num_ckpt = slots.ckpt_offsets.shape[1]
    why = unsupported_reason(rows, heads, dk, dv, num_ckpt, state.dtype, nvec, buffers)
    if why:
        raise ValueError(f"the Mosaic GPU decode cannot take this batch: {why}")
    hp = _round_up(heads, LANES)
    gates = jnp.pad(gates.astype(f32), [(0, 0), (0, 0), (0, hp - heads)])
    meta = _slot_rows(slots)
    items = rows * heads * (dv // BV)
    if programs is None:
        programs = 4 if interpret else PROGRAMS_PER_SM * _num_sms()
    programs = max(1, min(programs, items))
    scratch = (
        plgpu.SMEM((buffers, BV, dk), state.dtype),
        plgpu.SMEM((buffers, nvec, dk), f32),
        plgpu.SMEM((buffers, 3, hp), f32),
        plgpu.SMEM((buffers, BV), f32),
        plgpu.SMEM((BV,), f32),
        plgpu.SMEM(meta.shape, jnp.int32),
        plgpu.Barrier(num_arrivals=4, num_barriers=buffers),
        plgpu.Barrier(num_arrivals=1, num_barriers=1),
    )
    body = functools.partial(
        _body,
        ops=InterpretOps if interpret else GpuOps,
        programs=programs,
        buffers=buffers,
        stream_only=stream_only,
        ratio=heads // hk,
        per_channel=nvec == 3,
    )
    mesh = plgpu.Mesh(grid=(programs,), grid_names=("c",))
    o_type = jax.ShapeDtypeStruct((rows, heads, dv), f32)
    args = (meta, vectors.astype(f32), gates, v.astype(f32))
    written = meta[1 : 2 + num_ckpt, :rows]  # dst, then each checkpoint slot (0: none)
    o, state = pool_kernel(
        body, scratch, mesh, args, state, o_type, written, name=f"{name}_mgpu", interpret=interpret
    )
    return o.astype(out_dtype), state


def _family(inputs, name: str):
    def decode(q, k, v, gate, b, A_log, dt_bias, state, slots, **kw):
        acts = inputs(q, k, v, gate, b, A_log, dt_bias)
        return decode_mgpu(*acts, state, slots, out_dtype=v.dtype, name=name, **kw)

    return decode


# ``gdn.gpu.gdn_decode``'s / ``kda.gpu.kda_decode``'s arguments and results, on this kernel
# (``gate``: GDN's ``a [S, Hv]``, KDA's raw ``g [S, H, Dk]``).
gdn_decode_mgpu = _family(gdn_inputs, "gdn_decode")
kda_decode_mgpu = _family(kda_inputs, "kda_decode")
