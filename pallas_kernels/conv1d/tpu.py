"""Causal depthwise conv1d + SiLU Pallas kernels for TPU (Mosaic), with explicit state slots.

Same signatures and semantics as :mod:`pallas_kernels.conv1d.reference` (DESIGN.md §3);
``interpret`` is passed to ``pallas_call``.

Prefill
-------
The ragged batch is cut into chunks (:mod:`pallas_kernels.common.chunking`, chunks never
straddle a sequence or a checkpoint offset). The wrapper gathers each chunk into a block of
``H + chunk`` rows, right-aligned, whose top ``H`` rows (``H = K - 1`` rounded up to 8) are
the halo: the inputs before the chunk, taken from the same sequence or, before its first
token, from the source slot's window (zeros for ``src_slot == 0``)::

    K = 4, chunk = 8, a chunk of 5 tokens at the start of a sequence with window p0 p1 p2:

    block row:  0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15
    holds:      0  0  0  0  0  0  0  0  0 p0 p1 p2 x0 x1 x2 x3 x4
                                     (H = 8 halo rows)   ^ chunk rows, right-aligned
    y row i  = silu(sum_j w[j] * block[H - (K-1) + i + j])      (last 5 rows are real)
    window after the chunk = block[-(K-1):] = x2 x3 x4   -> ckpt / dst slots by DMA

Right alignment makes the window after the chunk a static slice, whatever the chunk length.
grid = (C // CB "parallel", NC "arbitrary").

Update (decode)
---------------
grid = (C // CB "parallel", S "arbitrary"); the window ``conv_state[src[s]]`` streams in
through the pipeline (data-dependent index map); the new window ``[w1 .. w_{K-2}, x]`` goes out
by DMA to ``dst[s]`` and to checkpoint slots with offset 1.

Assumptions: ``K - 1 <= 8``; ``C`` a multiple of 128 when ``channels_per_block < C``.
A slot written in a launch is not another row's source in that launch (DESIGN.md §4).
The ``[num_slots, K-1, C]`` state layout pads ``K - 1 = 3`` rows to a full (8 or 16)-row
tile in HBM on TPU; a ``[K-1, num_slots, C]`` layout would not.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common.chunking import gather_chunks, max_chunks, plan_chunks, scatter_tokens
from pallas_kernels.common.ragged import read_slots
from pallas_kernels.common.slots import StateSlots
from pallas_kernels.conv1d.reference import check_conv1d_args

CHUNK = 128


def _channels_per_block(c: int, requested: int | None) -> int:
    cb = c if requested is None else requested
    if c % cb or (cb != c and cb % 128):
        raise ValueError(f"channels_per_block={cb} must divide C={c} and be a multiple of 128")
    return cb


def _silu(x):
    return x * jax.nn.sigmoid(x)


def _sync_copy(src_ref, dst_ref, sem, when):
    @pl.when(when)
    def _():
        cp = pltpu.make_async_copy(src_ref, dst_ref, sem)
        cp.start()
        cp.wait()


# ----------------------------------------------------------------------------- prefill


def _prefill_kernel(
    c_seq, c_end, c_last, n_chunks, dst, ck_off, ck_slot,  # scalar prefetch
    w_ref,  # [K, CB]
    x_ref,  # [1, H + chunk, CB]
    pool_in,  # ANY [num_slots, K-1, C] (read by the wrapper's gather; only aliased here)
    y_ref,  # [1, chunk, CB]
    pool_out,  # ANY [num_slots, K-1, C], aliased
    win_scr,  # VMEM [K-1, CB] state dtype
    sem,
    *, max_ckpt: int,
):  # fmt: skip
    del pool_in
    cb, c = pl.program_id(0), pl.program_id(1)
    kw, width = w_ref.shape
    chunk = y_ref.shape[1]
    halo = x_ref.shape[1] - chunk
    chans = pl.ds(cb * width, width)

    @pl.when(c < n_chunks[0])
    def _():
        xw = x_ref[0].astype(jnp.float32)  # [H + chunk, CB]
        w = w_ref[...].astype(jnp.float32)
        acc = jnp.zeros((chunk, width), jnp.float32)
        for j in range(kw):
            lo = halo - (kw - 1) + j
            acc = acc + w[j : j + 1] * xw[lo : lo + chunk]
        y_ref[0] = _silu(acc).astype(y_ref.dtype)
        win_scr[...] = xw[halo + chunk - (kw - 1) :].astype(win_scr.dtype)
        seq = c_seq[c]
        for m in range(max_ckpt):
            slot = ck_slot[seq * max_ckpt + m]
            hit = (slot > 0) & (ck_off[seq * max_ckpt + m] == c_end[c])
            _sync_copy(win_scr, pool_out.at[slot, :, chans], sem, hit)
        slot = dst[seq]
        _sync_copy(win_scr, pool_out.at[slot, :, chans], sem, (c_last[c] == 1) & (slot > 0))


def causal_conv1d_prefill(
    x: jax.Array,  # [T, C] pre-conv inputs, model dtype
    weight: jax.Array,  # [C, K]
    conv_state: jax.Array,  # [num_slots, K-1, C]  donated: updated in place
    query_start_loc: jax.Array,  # i32[S+1]
    slots: StateSlots,  # DESIGN.md §3
    *,
    chunk: int = CHUNK,
    channels_per_block: int | None = None,
    interpret=False,
) -> tuple[jax.Array, jax.Array]:
    """Ragged prefill; see the module docstring. Returns ``(y [T, C], conv_state)``.

    Writes the window after the last token to ``dst_slot`` and after ``ckpt_offsets`` tokens
    to ``ckpt_slots`` for live rows; padding tokens give 0.
    """
    check_conv1d_args(x, weight, conv_state, slots, query_start_loc)
    n, c = x.shape
    kw = weight.shape[1]
    km1 = kw - 1
    rows, max_ckpt = slots.ckpt_offsets.shape
    cb = _channels_per_block(c, channels_per_block)
    halo = 8
    plan = plan_chunks(query_start_loc, slots, num_tokens=n, chunk=chunk)
    nc = max_chunks(n, rows, max_ckpt, chunk)

    # Block row r of chunk c holds position p = end - (H + chunk) + r of its sequence:
    # x for p >= 0, the source window for -(K-1) <= p < 0, else 0 (index out of bounds).
    r = jnp.arange(halo + chunk, dtype=jnp.int32)[None, :]
    p = plan.end[:, None] - (halo + chunk) + r  # [NC, H + chunk]
    seq = plan.seq[:, None]
    from_x = query_start_loc[seq] + p
    from_state = n + seq * km1 + km1 + p
    oob = n + rows * km1
    idx = jnp.where(p >= 0, from_x, jnp.where(p >= -km1, from_state, oob))
    idx = jnp.where(plan.length[:, None] > 0, idx, oob)
    init = read_slots(conv_state, slots.src_slot).astype(x.dtype)  # [S, K-1, C]
    xw = gather_chunks(jnp.concatenate([x, init.reshape(rows * km1, c)]), idx)

    def chunk_map(ci, k, c_seq, c_end, c_last, nch, *_):
        return (jnp.minimum(k, jnp.maximum(nch[0] - 1, 0)), 0, ci)

    _, dst, ck_off, ck_slot, _ = slots.flat()
    prefetch = (plan.seq, plan.end, plan.last, plan.num_chunks, dst, ck_off, ck_slot)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch),
        grid=(c // cb, nc),
        in_specs=[
            pl.BlockSpec((kw, cb), lambda ci, k, *_: (0, ci)),
            pl.BlockSpec((1, halo + chunk, cb), chunk_map),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=[
            pl.BlockSpec((1, chunk, cb), chunk_map),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        scratch_shapes=[pltpu.VMEM((km1, cb), conv_state.dtype), pltpu.SemaphoreType.DMA(())],
    )
    yc, conv_state = pl.pallas_call(
        functools.partial(_prefill_kernel, max_ckpt=max_ckpt),
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((nc, chunk, c), x.dtype),
            jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
        ],
        input_output_aliases={len(prefetch) + 2: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="causal_conv1d_prefill",
    )(*prefetch, weight.T, xw, conv_state)
    return scatter_tokens(yc, plan), conv_state


# ----------------------------------------------------------------------------- update


def _update_kernel(
    src, dst, ck_off, ck_slot, n_seqs,  # scalar prefetch
    w_ref,  # [K, CB]
    x_ref,  # [1, 1, CB]
    s_ref,  # [1, K-1, CB]  conv_state[src[r]], pipelined
    y_ref,  # [1, 1, CB]
    pool_out,  # ANY, aliased
    win32,  # VMEM f32[K-1, CB]
    win_scr,  # VMEM [K-1, CB] state dtype
    sem,
    *, max_ckpt: int,
):  # fmt: skip
    cb, r = pl.program_id(0), pl.program_id(1)
    kw, width = w_ref.shape
    chans = pl.ds(cb * width, width)
    live = r < n_seqs[0]

    @pl.when(live)
    def _():
        w = w_ref[...].astype(jnp.float32)
        st = jnp.where(src[r] > 0, s_ref[0].astype(jnp.float32), 0.0)  # [K-1, CB]
        xr = x_ref[0].astype(jnp.float32)  # [1, CB]
        acc = w[kw - 1 : kw] * xr
        for j in range(kw - 1):
            acc = acc + w[j : j + 1] * st[j : j + 1]
        y_ref[0] = _silu(acc).astype(y_ref.dtype)
        for j in range(kw - 2):  # the window slides by one token
            win32[j : j + 1] = st[j + 1 : j + 2]
        win32[kw - 2 : kw - 1] = xr
        win_scr[...] = win32[...].astype(win_scr.dtype)
        for m in range(max_ckpt):
            slot = ck_slot[r * max_ckpt + m]
            hit = (slot > 0) & (ck_off[r * max_ckpt + m] == 1)
            _sync_copy(win_scr, pool_out.at[slot, :, chans], sem, hit)
        _sync_copy(win_scr, pool_out.at[dst[r], :, chans], sem, dst[r] > 0)

    @pl.when(~live)
    def _():
        y_ref[...] = jnp.zeros_like(y_ref)


def causal_conv1d_update(
    x: jax.Array,  # [S, C] one new token per row
    weight: jax.Array,  # [C, K]
    conv_state: jax.Array,  # [num_slots, K-1, C]  donated: updated in place
    slots: StateSlots,  # DESIGN.md §3
    *,
    channels_per_block: int | None = None,
    interpret=False,
) -> tuple[jax.Array, jax.Array]:
    """Decode: one token per row. Returns ``(y [S, C], conv_state)``."""
    check_conv1d_args(x, weight, conv_state, slots)
    rows, c = x.shape
    if rows != slots.num_rows:
        raise ValueError(f"update rows {rows} must equal {slots.num_rows=} (one token each)")
    kw = weight.shape[1]
    max_ckpt = slots.ckpt_offsets.shape[1]
    cb = _channels_per_block(c, channels_per_block)

    def row_map(ci, r, *_):
        return (r, 0, ci)

    def state_map(ci, r, src, dst, ck_off, ck_slot, n):
        return (jnp.where(r < n[0], src[r], 0), 0, ci)  # src 0: fetched, never used

    prefetch = slots.flat()
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch),
        grid=(c // cb, rows),
        in_specs=[
            pl.BlockSpec((kw, cb), lambda ci, r, *_: (0, ci)),
            pl.BlockSpec((1, 1, cb), row_map),
            pl.BlockSpec((1, kw - 1, cb), state_map),
        ],
        out_specs=[
            pl.BlockSpec((1, 1, cb), row_map),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        scratch_shapes=[
            pltpu.VMEM((kw - 1, cb), jnp.float32),
            pltpu.VMEM((kw - 1, cb), conv_state.dtype),
            pltpu.SemaphoreType.DMA(()),
        ],
    )
    y, conv_state = pl.pallas_call(
        functools.partial(_update_kernel, max_ckpt=max_ckpt),
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((rows, 1, c), x.dtype),
            jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
        ],
        input_output_aliases={len(prefetch) + 2: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="causal_conv1d_update",
    )(*prefetch, weight.T, x.reshape(rows, 1, c), conv_state)
    return y.reshape(rows, c), conv_state
