"""Causal depthwise conv1d + SiLU prefill in Mosaic GPU (TMA tiles), with explicit state slots.

Same signature and semantics as :func:`pallas_kernels.conv1d.reference.
causal_conv1d_prefill_reference` (DESIGN.md §3). Not yet run on a GPU, and no caller takes it by
default: the Triton kernel (:mod:`pallas_kernels.conv1d.gpu`) stays the conv of every GPU
layer. Measured there at 48 / 64 / 66 % of copy (1x4096, 1x16384, 8x4096 on an H200), against
64 / 86 / 94 % for a bare ``silu`` pass over the same bytes in Mosaic GPU (BENCHMARKS.md): the
Triton kernel's per-row vectors and window programs cost the rest. This one is that bare pass
plus the taps:

1. One Mosaic GPU launch over ``[64, 128]`` tiles of ``y``, the batch read as one sequence:
   a program copies the tile's rows and the 8 before them (``[72, 128]``, one TMA box; the
   first tile its 64 rows, its 8 rows before the batch never used) and the weights
   (``[K, 128]``), and tap ``j`` of its rows is the box's rows shifted by ``j``: no halo
   logic, no per-token row search. Tokens past ``query_start_loc[num_seqs]`` give 0.
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

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common.chunk_scan_mgpu import GpuOps, InterpretOps, _plgpu
from pallas_kernels.common.ragged import read_slots
from pallas_kernels.common.slots import StateSlots
from pallas_kernels.conv1d.reference import check_conv1d_args, row_start_outputs, write_windows

BT = 64  # tokens a tile: the WGMMA layout's rows
BC = 128  # channels a tile
HALO = 8  # rows copied before a tile (K - 1 of them used): a multiple of 8 keeps boxes aligned
META = 32  # i32 values of the scalars' copy (128 bytes)
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


def _body(refs, scratch, *, ops, width: int):
    plgpu = _plgpu()
    x_ref, w_ref, meta_ref, y_ref = refs
    xs, ws, ms, ys, bar = scratch
    tb, cb = jax.lax.axis_index("t"), jax.lax.axis_index("c")
    t0, cols = tb * BT, pl.ds(cb * BC, BC)

    @pl.when(tb == 0)
    def _():  # the batch's first tile: its rows only (the 8 before it are never used)
        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(0, BT), cols], xs.at[pl.ds(HALO, BT)], bar.at[0])

    @pl.when(tb > 0)
    def _():
        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(t0 - HALO, BT + HALO), cols], xs, bar.at[0])

    plgpu.copy_gmem_to_smem(w_ref.at[:, cols], ws, bar.at[0])
    plgpu.copy_gmem_to_smem(meta_ref, ms, bar.at[0])
    plgpu.barrier_wait(bar.at[0])
    acc = ops.zeros((BT, BC))
    for j in range(width):  # y[t] = sum_j w[j] x[t + j - (K-1)], the reference's order
        tap = ops.load(xs.at[pl.ds(HALO - (width - 1) + j, BT)], optimized=False).astype(f32)
        w = jax.lax.broadcast_in_dim(ops.load_row_vector(ws.at[j]).astype(f32), (BT, BC), (1,))
        acc = tap * w if j == 0 else acc + tap * w
    y = acc * jax.nn.sigmoid(acc)
    live = t0 + ops.iota((BT, BC), 0) < ms[0]  # padding tokens give 0
    ys[...] = jnp.where(live, y, 0.0).astype(ys.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(ys, y_ref.at[pl.ds(t0, BT), cols])
    plgpu.wait_smem_to_gmem(0)


def _main_pass(x, weight, n_live, *, interpret: bool) -> jax.Array:
    """Step 1 of the module docstring: ``y [T, C]``, the batch as one sequence."""
    plgpu = _plgpu()
    n, c = x.shape
    width = weight.shape[1]
    w_t = weight.T.astype(x.dtype)  # [K, C]: a tile's weights are one box
    meta = jnp.zeros((META,), jnp.int32).at[0].set(n_live)
    scratch = (
        plgpu.SMEM((BT + HALO, BC), x.dtype),
        plgpu.SMEM((width, BC), x.dtype),
        plgpu.SMEM((META,), jnp.int32),
        plgpu.SMEM((BT, BC), x.dtype),
        plgpu.Barrier(num_arrivals=3, num_barriers=1),
    )
    ops = InterpretOps if interpret else GpuOps

    def kernel(*refs):
        pl.run_scoped(lambda *s: _body(refs, s, ops=ops, width=width), *scratch)

    mesh = plgpu.Mesh(grid=(n // BT, c // BC), grid_names=("t", "c"))
    out = jax.ShapeDtypeStruct((n, c), x.dtype)
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        call = pl.kernel(kernel, out_type=out, mesh=mesh, interpret=InterpretGPUParams(),
                         name="conv1d_prefill_mgpu")  # fmt: skip
    else:
        params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
        call = pl.kernel(kernel, out_type=out, mesh=mesh, compiler_params=params,
                         name="conv1d_prefill_mgpu")  # fmt: skip
    return call(x, w_t, meta)


def causal_conv1d_prefill_mgpu(
    x: jax.Array,  # [T, C] pre-conv inputs, 16-bit
    weight: jax.Array,  # [C, K]
    conv_state: jax.Array,  # [num_slots, K-1, C]  donated: updated in place
    query_start_loc: jax.Array,  # i32[S+1]
    slots: StateSlots,  # DESIGN.md §3
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Ragged prefill (module docstring). Returns ``(y [T, C], conv_state)``; padding tokens
    give 0. A shape :func:`unsupported_reason` names is a ``ValueError``."""
    check_conv1d_args(x, weight, conv_state, slots, query_start_loc)
    if why := unsupported_reason(*x.shape, weight.shape[1], x.dtype):
        raise ValueError(f"the Mosaic GPU conv cannot take this prefill: {why}")
    qsl = query_start_loc.astype(jnp.int32)
    init = read_slots(conv_state, slots.src_slot)  # [S, K-1, C], before the pool is written
    n_live = qsl[jnp.asarray(slots.num_seqs, jnp.int32)]
    y = _main_pass(x, weight, n_live, interpret=interpret)
    tokens, starts = row_start_outputs(x, weight, init, qsl, slots)
    y = y.at[tokens].set(starts, mode="drop")
    return y, write_windows(x, init, conv_state, qsl, slots)
