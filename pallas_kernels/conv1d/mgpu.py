"""Causal depthwise conv1d + SiLU prefill in Mosaic GPU (TMA tiles), with explicit state slots.

Same signature and semantics as :func:`pallas_kernels.conv1d.reference.
causal_conv1d_prefill_reference` (DESIGN.md §3). Not yet run on a GPU, and no caller takes it by
default: the Triton kernel (:mod:`pallas_kernels.conv1d.gpu`) stays the conv of every GPU
layer. Measured there at 48 / 64 / 66 % of copy (1x4096, 1x16384, 8x4096 on an H200), against
64 / 86 / 94 % for a bare ``silu`` pass over the same bytes in Mosaic GPU (BENCHMARKS.md): the
Triton kernel's per-row vectors and window programs cost the rest. This one is that bare pass
plus the taps:

1. One Mosaic GPU launch over ``[64, 128]`` tiles of ``y``, the batch read as one sequence:
   for each tile, a program copies its rows and the 8 before them (``[72, 128]``, one TMA
   box; the batch's first tile its 64 rows, its 8 rows before the batch never used), and tap
   ``j`` of its rows is the box's rows shifted by ``j``: no halo logic, no per-token row
   search. A program walks ``steps`` tiles down the tokens, the next one's copy in flight
   while it computes one, each tile's output stored by TMA from one of two buffers; the
   weights (``[K, 128]``) are copied once. Tokens past ``query_start_loc[num_seqs]`` give 0.
2. Each live row's first ``K - 1`` tokens, whose taps reach into its source window instead of
   the previous row's tokens, are recomputed from the window and written over (XLA:
   ``S (K - 1)`` tokens, :func:`~pallas_kernels.conv1d.reference.row_start_outputs`).
3. The windows to ``dst`` and the checkpoint slots (XLA, ``S (M + 1) (K - 1)`` rows,
   :func:`~pallas_kernels.conv1d.reference.write_windows`), from the source windows read
   before anything is written.

Takes ``T`` a multiple of 64, ``C`` of 128, 16-bit ``x`` and ``K <= 9``
(:func:`unsupported_reason`). ``interpret=True`` runs it in Pallas' GPU interpreter on a CPU host.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common.chunk_scan_mgpu import GpuOps, InterpretOps, _plgpu, mgpu_kernel
from pallas_kernels.common.ragged import read_slots
from pallas_kernels.common.slots import StateSlots
from pallas_kernels.conv1d.reference import check_conv1d_args, row_start_outputs, write_windows

BT = 64  # tokens a tile: the WGMMA layout's rows
BC = 128  # channels a tile
HALO = 8  # rows copied before a tile (K - 1 of them used): a multiple of 8 keeps boxes aligned
META = 32  # i32 values of the scalars' copy (128 bytes)
STEPS = 4  # tiles a program walks: a guess until measured (the bare pass's best kept 2 in flight)
f32 = jnp.float32


def unsupported_reason(num_tokens: int, channels: int, width: int, dtype) -> str | None:
    """Why this kernel cannot take a conv (the Triton one then should), or None."""
    if num_tokens % BT:
        return f"T={num_tokens} (a multiple of {BT})"
    if channels % BC:
        return f"C={channels} (a multiple of {BC})"
    if jnp.dtype(dtype).itemsize != 2:
        return f"x of {jnp.dtype(dtype).name} (16-bit)"
    if width - 1 > HALO:
        return f"K={width} (at most {HALO + 1})"
    return None


def _body(refs, scratch, *, ops, width: int, steps: int):
    plgpu = _plgpu()
    x_ref, w_ref, meta_ref, y_ref = refs
    xs, ws, ms, ys, bars, wbar = scratch
    pb, cb = jax.lax.axis_index("t"), jax.lax.axis_index("c")
    cols = pl.ds(cb * BC, BC)
    first = pb * steps  # this program's first tile; it owns up to ``steps`` in a row
    count = jnp.minimum(steps, x_ref.shape[0] // BT - first)

    def issue(i, slot):  # tile first + i's rows and the 8 before them into buffer ``slot``
        t0 = (first + i) * BT

        @pl.when(t0 == 0)
        def _():  # the batch's first tile: its rows only (the 8 before it are never used)
            dst = xs.at[slot, pl.ds(HALO, BT)]
            plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(0, BT), cols], dst, bars.at[slot])

        @pl.when(t0 > 0)
        def _():
            src = x_ref.at[pl.ds(t0 - HALO, BT + HALO), cols]
            plgpu.copy_gmem_to_smem(src, xs.at[slot], bars.at[slot])

    plgpu.copy_gmem_to_smem(w_ref.at[:, cols], ws, wbar.at[0])
    plgpu.copy_gmem_to_smem(meta_ref, ms, wbar.at[0])
    issue(0, 0)
    plgpu.barrier_wait(wbar.at[0])

    def step(i, carry):
        slot = i % 2

        @pl.when(i + 1 < count)
        def _():  # the other buffer's tile is in registers already
            issue(i + 1, 1 - slot)

        plgpu.barrier_wait(bars.at[slot])
        acc = None
        for j in range(width):  # y[t] = sum_j w[j] x[t + j - (K-1)], the reference's order
            rows = pl.ds(HALO - (width - 1) + j, BT)
            tap = ops.load(xs.at[slot, rows], optimized=False).astype(f32)
            w = ops.load_row_vector(ws.at[j]).astype(f32)
            term = tap * jax.lax.broadcast_in_dim(w, (BT, BC), (1,))
            acc = term if j == 0 else acc + term
        y = acc * jax.nn.sigmoid(acc)
        t0 = (first + i) * BT
        live = t0 + ops.iota((BT, BC), 0) < ms[0]  # padding tokens give 0
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # tile i - 2's store has read ys[slot]
        ys.at[slot][...] = jnp.where(live, y, 0.0).astype(ys.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(ys.at[slot], y_ref.at[pl.ds(t0, BT), cols])
        return carry

    jax.lax.fori_loop(0, count, step, 0)
    plgpu.wait_smem_to_gmem(0)


def _main_pass(x, weight, n_live, *, steps: int, interpret: bool) -> jax.Array:
    """Step 1 of the module docstring: ``y [T, C]``, the batch as one sequence; a program
    walks ``steps`` consecutive tiles, the next one's copy in flight while it computes one."""
    plgpu = _plgpu()
    n, c = x.shape
    width = weight.shape[1]
    w_t = weight.T.astype(x.dtype)  # [K, C]: a tile's weights are one box
    meta = jnp.zeros((META,), jnp.int32).at[0].set(n_live)
    scratch = (
        plgpu.SMEM((2, BT + HALO, BC), x.dtype),
        plgpu.SMEM((width, BC), x.dtype),
        plgpu.SMEM((META,), jnp.int32),
        plgpu.SMEM((2, BT, BC), x.dtype),
        plgpu.Barrier(num_arrivals=1, num_barriers=2),
        plgpu.Barrier(num_arrivals=2, num_barriers=1),
    )
    ops = InterpretOps if interpret else GpuOps

    def kernel(*refs):
        body = functools.partial(_body, ops=ops, width=width, steps=steps)
        pl.run_scoped(lambda *s: body(refs, s), *scratch)

    mesh = plgpu.Mesh(grid=(pl.cdiv(n // BT, steps), c // BC), grid_names=("t", "c"))
    out = jax.ShapeDtypeStruct((n, c), x.dtype)
    call = mgpu_kernel(kernel, out, mesh, name="conv1d_prefill_mgpu", interpret=interpret)
    return call(x, w_t, meta)


def causal_conv1d_prefill_mgpu(
    x: jax.Array,  # [T, C] pre-conv inputs, 16-bit
    weight: jax.Array,  # [C, K]
    conv_state: jax.Array,  # [num_slots, K-1, C]  donated: updated in place
    query_start_loc: jax.Array,  # i32[S+1]
    slots: StateSlots,  # DESIGN.md §3
    *,
    steps: int = STEPS,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Ragged prefill (module docstring). Returns ``(y [T, C], conv_state)``; padding tokens
    give 0. A shape :func:`unsupported_reason` names is a ``ValueError``. ``steps``: the
    tiles a program walks (each next one's copy in flight while it computes one)."""
    if steps < 1:
        raise ValueError(f"steps={steps}: at least 1")
    check_conv1d_args(x, weight, conv_state, slots, query_start_loc)
    if why := unsupported_reason(*x.shape, weight.shape[1], x.dtype):
        raise ValueError(f"the Mosaic GPU conv cannot take this prefill: {why}")
    qsl = query_start_loc.astype(jnp.int32)
    init = read_slots(conv_state, slots.src_slot)  # [S, K-1, C], before the pool is written
    n_live = qsl[jnp.asarray(slots.num_seqs, jnp.int32)]
    y = _main_pass(x, weight, n_live, steps=steps, interpret=interpret)
    tokens, starts = row_start_outputs(x, weight, init, qsl, slots)
    y = y.at[tokens].set(starts, mode="drop")
    return y, write_windows(x, init, conv_state, qsl, slots)
