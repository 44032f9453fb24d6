"""Causal depthwise conv1d + SiLU Pallas kernel for NVIDIA GPUs (Triton lowering), with slots.

Same signature and semantics as :func:`pallas_kernels.conv1d.reference.
causal_conv1d_prefill_reference` (DESIGN.md §3). Written for memory bandwidth: every input is
read once from HBM and every output written once; the taps are summed in float32.

Prefill, one launch, grid = (W + ceil(T / BT), ceil(C / BC))
-------------------------------------------------------------
The first ``W = S * (M + 1)`` programs along axis 0 write the conv windows (one per row and
target: the ``M`` checkpoints, then ``dst``); the others each own ``BT`` tokens x ``BC``
channels. Each output is ``y[t] = silu(sum_j w[:, j] * tap_j[t])`` over the inputs
``tap_j[t] = x[t + j - (K-1)]``, where a position before its row's first token reads the
source window instead::

    K = 4, a row starting at token 5 with window p0 p1 p2 (zeros when src == 0)

    token t:        5   6   7   8 ...        pos = t - qsl[row] + j - (K-1)
    tap j = 0:      p0  p1  p2  x5           pos < 0:  init[row, K-1 + pos]
    tap j = 1:      p1  p2  x5  x6           pos >= 0: x[t + j - (K-1)]
    tap j = 2:      p2  x5  x6  x7
    tap j = 3:      x5  x6  x7  x8

A token program takes one of two paths:

- inner tile (all ``BT`` tokens in one live row, at least ``K-1`` after its start; the row of
  the tile's first token comes from a scalar bisection over ``query_start_loc``): the
  ``BT + K-1`` rows ``x[t0 - (K-1) .. t0 + BT)`` are loaded once each, as separate ``[BC]``
  vectors, and tap ``j`` of token ``i`` is vector ``i + j``: no reloads (the HBM and L2 bytes
  are the floor's, plus ``K-1`` halo rows per tile), no row masks (loading the ``[BT, BC]`` tile
  once a tap, shifted by a row each time, was slower: BENCHMARKS.md);
- any other tile (a row start, padding tokens, the batch's end): each token finds its row by
  a vector bisection; every tap is a masked ``[BT, 128]`` load from ``x`` plus one from the
  source window.

A window program writes ``[K-1, BC]`` rows ``off - (K-1) .. off - 1`` of its row (from ``x``,
or from the source window where negative) to its slot; ``off`` is the checkpoint's offset, or
the row's length for ``dst``. Nothing else is written to the pool.

The inputs need not be one ``[T, C]`` array: channel ``c`` is read at column
``xcol[c // run] + c % run`` of ``x`` (runs of contiguous channels, one table entry each), and
the outputs may be several arrays, consecutive channel ranges (``splits``).
:func:`causal_conv1d_prefill` is the plain case (x's columns are the channels, one output:
no table read, no branch on the output);
:func:`causal_conv1d_prefill_qkvz` reads a GDN layer's q | k | v where its input projection
leaves them (interleaved per key head with z) and writes q, k and v apart: the conv without
the layer's packing pass before it and slicing pass after it (the GDN layer's prefill conv
on NVIDIA: 1.43x / 1.53x / 1.63x the packed path at B=1 T=4096, B=1 T=16384, B=8 T=4096 on an
H200, BENCHMARKS.md).

Reads before writes: the source windows of all rows are gathered (``read_slots``, one small
XLA fusion of ``S * (K-1) * C`` elements) before the launch, and the kernel reads that copy,
never the pool. So a row that updates its slot in place (``src == dst``) cannot see its new
window: the programs of one launch run in no fixed order, and a token program reading
``pool[src]`` could otherwise run after the window program that overwrote it.

Decode update, one launch, grid = (S, C / BC)
--------------------------------------------
:func:`causal_conv1d_update` (the signature of ``causal_conv1d_update_reference``): program
``(r, c)`` reads row ``r``'s window of channels ``[c * BC, (c + 1) * BC)`` from its source
slot, convolves it with this token, and writes the shifted window to ``dst`` and to the
checkpoints at offset 1. A channel of a row is read and written by its one program, and no
row reads a slot another row writes (a shared source is a checkpoint, never a ``dst``), so the
in-place update (``src == dst``) needs no copy. ``splits`` hands the output channels back as
several arrays (a layer's q | k | v, each then contiguous for the decode kernel that takes it,
with no XLA slice copy between the two). ``BC`` is a power of two dividing every split.

Prefill: any ``C`` (channel tiles are masked), any ``K`` in [2, 9], any dtypes the reference takes.
``interpret=True`` runs the kernel in Pallas' interpreter on CPU (the tests). Loads that may
leave the array (a tap above the first token, the last partial tile) index with clamped
integer arrays, stores with slices: the interpreter clamps a negative slice start (shifting
the data), and resolves a clamped duplicate index of a masked store in no fixed order.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common.conv_decode_gpu import row_writes, shift_window, silu_conv, window_of
from pallas_kernels.common.delta_rule import group_refs
from pallas_kernels.common.delta_rule_gpu import DecodeSlots
from pallas_kernels.common.ragged import read_slots
from pallas_kernels.common.slots import StateSlots
from pallas_kernels.conv1d.reference import (
    check_conv1d_args,
    check_qkvz_args,
    check_split_args,
    packed_inputs,
    packed_qkvz,
)

log = logging.getLogger(__name__)

# The sweeps (benchmarks.conv1d_kernels --sweep) on an H200, C=8192 bf16: 256 channels x 8
# tokens on 2 warps beat 16 tokens at B=1 T=4096 / T=16384 / B=8 T=4096 (69 / 224 / 437 vs 78-89
# / 243-254 / 462-464 us, one process, 2026-11-29); 512-channel tiles are slower (half the
# registers a thread, more programs resident on an SM), as are [BT, BC] loads a tap (9151e45).
BLOCK_T = 8
BLOCK_C = 256
SUB_C = 128  # the channels of one [BT, SUB_C] tile of the general path


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _silu(x):
    return x * jax.nn.sigmoid(x)


def _row_of(qsl_ref, t, num_rows: int):
    """``searchsorted(query_start_loc[1:], t, side="right")`` by bisection, clamped to S - 1:
    the row of each token ``t`` (any int array). ``num_rows.bit_length()`` halvings narrow the
    ``S + 1`` candidates ``[0, S]`` to one."""
    lo = jnp.zeros_like(t)
    hi = jnp.full_like(t, num_rows)
    for _ in range(num_rows.bit_length()):
        mid = (lo + hi) // 2
        end = pltr.load(qsl_ref.at[jnp.minimum(mid + 1, num_rows)])  # end of row mid
        right = (lo < hi) & (end <= t)
        hi = jnp.where((lo < hi) & ~right, mid, hi)
        lo = jnp.where(right, mid + 1, lo)
    return jnp.minimum(lo, num_rows - 1)


def _prefill_kernel(
    qsl_ref,  # i32[S+1]
    nseq_ref,  # i32[1]
    dst_ref,  # i32[S]
    ck_off_ref, ck_slot_ref,  # i32[S, M]
    *refs,  # the inputs x: one [T, X] (channel c of run p at column xcol[p] + c % run) or
    #         one [T, n] per input split; xcol i32[C / run] (with a run), w [C, K], init
    #         [S, K-1, C] (the source windows, zeros where src == 0), pool_in (aliased to
    #         pool_out, never read), the outputs y (one [T, n] per split), pool_out
    #         [num_slots, K-1, C]
    block_t: int, block_c: int, sub_c: int, run: int | None, splits: tuple[int, ...],
    in_splits: tuple[int, ...],
):  # fmt: skip
    x_refs, refs = refs[: len(in_splits)], refs[len(in_splits) :]
    xcol_ref = None
    if run is not None:
        xcol_ref, *refs = refs
    w_ref, init_ref, _, *ys, pool_out = refs
    # (the program ids read here: Pallas' interpreter has none inside a pl.when)
    pid, cb = pl.program_id(0), pl.program_id(1)
    program = functools.partial(
        _prefill_program, pid, cb, qsl_ref, nseq_ref, dst_ref, ck_off_ref, ck_slot_ref,
        xcol_ref=xcol_ref, w_ref=w_ref, init_ref=init_ref, ys=ys, pool_out=pool_out,
        block_t=block_t, block_c=block_c, sub_c=sub_c, run=run, splits=splits,
    )  # fmt: skip
    if len(x_refs) == 1:  # one input: every channel tile reads it
        program(x_refs[0], 0)
        return
    lo = 0  # several: a channel tile lies in one input (its split is a multiple of BC)
    for x_ref, n in zip(x_refs, in_splits, strict=True):

        @pl.when((cb * block_c >= lo) & (cb * block_c < lo + n))
        def _(x_ref=x_ref, lo=lo):
            program(x_ref, lo)

        lo += n


def _prefill_program(
    pid, cb,  # the program's ids: window or token tile, channel tile
    qsl_ref, nseq_ref, dst_ref, ck_off_ref, ck_slot_ref,
    x_ref,  # the input holding this program's channels, from channel x_lo on
    x_lo: int,
    *, xcol_ref, w_ref, init_ref, ys, pool_out, block_t: int, block_c: int, sub_c: int,
    run: int | None, splits: tuple[int, ...],
):  # fmt: skip
    """One program of :func:`_prefill_kernel` on the input ``x_ref``."""
    num_tokens = x_ref.shape[0]
    c, kw = w_ref.shape
    km1 = kw - 1
    rows, max_ckpt = ck_off_ref.shape
    num_windows = rows * (max_ckpt + 1)
    f32 = jnp.float32
    vw = block_c if run is None else min(block_c, run)  # the widest vector inside one run

    def iota(width: int, ndim: int):
        shape = (width,) if ndim == 1 else (1, width)
        return jax.lax.broadcasted_iota(jnp.int32, shape, ndim - 1)

    def channels(first: int, width: int, ndim: int):
        """Channels ``cb * BC + first + [0, width)`` as ``[width]`` or ``[1, width]``, their
        in-bounds mask, and x's columns holding them (``width`` inside one run)."""
        ch0 = cb * block_c + first
        cols = ch0 + iota(width, ndim)
        if xcol_ref is None:  # x's columns are the channels from x_lo on
            return cols, cols < c, cols - x_lo
        x0 = xcol_ref[jnp.minimum(ch0 // run, xcol_ref.shape[0] - 1)] + ch0 % run
        return cols, cols < c, x0 + iota(width, ndim)

    def store_y(rows_, first: int, width: int, y, mask):
        """``y`` into the output split holding channels ``cb * BC + first + [0, width)``."""
        ch0 = cb * block_c + first
        if len(ys) == 1:  # one output: every channel of the launch is in it
            pltr.store(ys[0].at[rows_, pl.ds(ch0, width)], y.astype(ys[0].dtype), mask=mask)
            return
        lo = 0
        for out, n in zip(ys, splits, strict=True):

            @pl.when((ch0 >= lo) & (ch0 < lo + n))
            def _(out=out, lo=lo):
                pltr.store(out.at[rows_, pl.ds(ch0 - lo, width)], y.astype(out.dtype), mask=mask)

            lo += n

    def tap_x(tok, xcols, ok):
        """``x[tok, xcols]`` in f32 where ``ok`` (zeros elsewhere, nothing read)."""
        tok = jnp.clip(tok, 0, num_tokens - 1)
        return pltr.load(x_ref.at[tok, xcols], mask=ok, other=0).astype(f32)

    def tap_init(row, pos, cols, ok):
        """``init[row, K-1 + pos, cols]`` (``pos`` in [-(K-1), 0)) in f32 where ``ok``."""
        r = jnp.clip(km1 + pos, 0, km1 - 1)
        return pltr.load(init_ref.at[row, r, cols], mask=ok, other=0).astype(f32)

    def weights(cols, ok):
        return [pltr.load(w_ref.at[cols, j], mask=ok, other=0).astype(f32) for j in range(kw)]

    @pl.when(pid < num_windows)
    def _():
        # Window program: row s, target j (< M: checkpoint j; == M: dst).
        s, j = pid // (max_ckpt + 1), pid % (max_ckpt + 1)
        start = qsl_ref[s]
        if max_ckpt:
            jc = jnp.minimum(j, max_ckpt - 1)
            is_dst = j == max_ckpt
            off = jnp.where(is_dst, qsl_ref[s + 1] - start, ck_off_ref[s, jc])
            slot = jnp.where(is_dst, dst_ref[s], ck_slot_ref[s, jc])
        else:
            off, slot = qsl_ref[s + 1] - start, dst_ref[s]
        kp = _pow2_at_least(km1)
        i = jax.lax.broadcasted_iota(jnp.int32, (kp, 1), 0)  # window row
        pos = off - km1 + i  # its position in the row's new tokens
        row_ok = (i < km1) & (s < nseq_ref[0]) & (slot > 0)
        for first in range(0, block_c, vw):
            cols, col_ok, xcols = channels(first, vw, 2)
            ok = row_ok & col_ok
            win = tap_x(start + pos, xcols, ok & (pos >= 0)) + tap_init(
                s, pos, cols, ok & (pos < 0)
            )
            chans = pl.ds(cb * block_c + first, vw)
            pltr.store(pool_out.at[slot, pl.ds(0, kp), chans], win.astype(pool_out.dtype), mask=ok)

    t0 = (pid - num_windows) * block_t
    n_live = qsl_ref[nseq_ref[0]]
    # The common tile: all its tokens in one live row, at least K-1 tokens after its start.
    row0 = _row_of(qsl_ref, t0, rows)
    inner = (t0 - qsl_ref[row0] >= km1) & (t0 + block_t <= jnp.minimum(qsl_ref[row0 + 1], n_live))

    @pl.when((pid >= num_windows) & inner)
    def _():
        # Rows as separate [BC] vectors (in runs of x), loaded once (the K-1 above the tile
        # too): the taps are the same vectors shifted by a list index, no reload, no mask but
        # the channels'.
        for first in range(0, block_c, vw):
            cols, col_ok, xcols = channels(first, vw, 1)
            xs = [
                pltr.load(x_ref.at[t0 + i, xcols], mask=col_ok, other=0)
                for i in range(-km1, block_t)
            ]  # xs[i + K-1] = x[t0 + i]
            w = weights(cols, col_ok)
            for i in range(block_t):
                acc = xs[i].astype(f32) * w[0]  # same order of sums as the reference
                for j in range(1, kw):
                    acc = acc + xs[i + j].astype(f32) * w[j]
                store_y(t0 + i, first, vw, _silu(acc), col_ok)

    @pl.when((pid >= num_windows) & ~inner)
    def _():
        # Tiles with a row start, padding or the end of the batch: each token finds its row
        # and reads the taps before it from the source window; [BT, sub_c] tiles.
        t = t0 + jax.lax.broadcasted_iota(jnp.int32, (block_t, 1), 0)  # [BT, 1] tokens
        live = t < n_live  # padding tokens give 0
        row = _row_of(qsl_ref, t, rows)
        local = t - pltr.load(qsl_ref.at[row])  # index in the row's new tokens
        for first in range(0, block_c, sub_c):
            cols, col_ok, xcols = channels(first, sub_c, 2)
            w = weights(cols, col_ok)
            acc = jnp.zeros((block_t, sub_c), f32)
            for j in range(kw):  # same order of sums as the reference
                d = j - km1
                pos = local + d
                v = tap_x(t + d, xcols, live & (pos >= 0) & col_ok)
                if d < 0:
                    v = v + tap_init(row, pos, cols, live & (pos < 0) & col_ok)
                acc = v * w[j] if j == 0 else acc + v * w[j]
            y = jnp.where(live, _silu(acc), 0.0)
            store_y(pl.ds(t0, block_t), first, sub_c, y, (t < num_tokens) & col_ok)


def _launch_prefill(
    xs, xcol, weight, conv_state, query_start_loc, slots, *, run: int | None,
    splits: tuple[int, ...], block_t: int, block_c: int, num_warps: int, num_stages: int,
    interpret: bool,
) -> tuple[jax.Array, ...]:  # fmt: skip
    """:func:`_prefill_kernel` over grid ``(W + ceil(T / BT), ceil(C / BC))``: the outputs
    (one per split), then the pool. ``xs``: the inputs, one ``[T, X]`` read through ``xcol``
    (with a ``run``), or ``[T, n]`` arrays whose columns are the channels in turn (every one
    but the last a multiple of BC wide, so that a channel tile lies in one)."""
    n = xs[0].shape[0]
    c = weight.shape[0]
    rows, max_ckpt = slots.ckpt_offsets.shape
    num_windows = rows * (max_ckpt + 1)
    src, dst, ck_off, ck_slot, num_seqs = slots.arrays()
    init = read_slots(conv_state, src)  # [S, K-1, C], read before the pool is written
    table = () if run is None else (jnp.asarray(xcol, jnp.int32),)
    args = (query_start_loc.astype(jnp.int32), num_seqs, dst, ck_off, ck_slot, *xs, *table,
            weight, init, conv_state)  # fmt: skip
    kernel = functools.partial(
        _prefill_kernel, block_t=block_t, block_c=block_c,
        sub_c=min(block_c, SUB_C, run or block_c), run=run, splits=splits,
        in_splits=tuple(x.shape[1] for x in xs) if run is None else (c,),
    )  # fmt: skip
    return tuple(
        pl.pallas_call(
            kernel,
            grid=(num_windows + pl.cdiv(n, block_t), pl.cdiv(c, block_c)),
            out_shape=[
                *(jax.ShapeDtypeStruct((n, k), xs[0].dtype) for k in splits),
                jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
            ],
            input_output_aliases={len(args) - 1: len(splits)},
            compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
            interpret=interpret,
            name="causal_conv1d_prefill_gpu",
        )(*args)
    )


def _check_blocks(block_t: int, block_c: int) -> None:
    for name, b in (("block_t", block_t), ("block_c", block_c)):
        if b < 1 or b & (b - 1):
            raise ValueError(f"{name}={b} must be a power of two")


def causal_conv1d_prefill(
    x: jax.Array,  # [T, C] pre-conv inputs, model dtype
    weight: jax.Array,  # [C, K]
    conv_state: jax.Array,  # [num_slots, K-1, C]  donated: updated in place
    query_start_loc: jax.Array,  # i32[S+1]
    slots: StateSlots,  # DESIGN.md §3
    *,
    block_t: int = BLOCK_T,
    block_c: int = BLOCK_C,
    num_warps: int = 2,
    num_stages: int = 1,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Ragged prefill; see the module docstring. Returns ``(y [T, C], conv_state)``.

    Writes the window after the last token to ``dst_slot`` and after ``ckpt_offsets`` tokens
    to ``ckpt_slots`` for live rows; padding tokens give 0. ``block_t`` and ``block_c`` (powers
    of two) are the token x channel tile, shrunk to the problem when it is smaller.
    """
    check_conv1d_args(x, weight, conv_state, slots, query_start_loc)
    _check_blocks(block_t, block_c)
    n, c = x.shape
    bt = min(block_t, _pow2_at_least(n))
    bc = min(block_c, _pow2_at_least(c))
    return _launch_prefill(
        (x,), None, weight, conv_state, query_start_loc, slots, run=None, splits=(c,), block_t=bt,
        block_c=bc, num_warps=num_warps, num_stages=num_stages, interpret=interpret,
    )  # fmt: skip


def qkvz_columns(num_k_heads: int, dk: int, dv: int, ratio: int, run: int) -> np.ndarray:
    """Where the GDN conv's channels sit in its projection's output, ``qkvz [T, Hk * W]``
    (``W = 2 Dk + 2 r Dv``: per key head ``q | k | v of its r value heads | z``): the column of
    the first channel of each ``run`` channels of ``q (all heads) | k | v`` (``run`` divides
    ``Dk`` and ``r Dv``, so a run is contiguous in ``qkvz``)."""
    w = 2 * dk + 2 * ratio * dv
    cols = []
    for width, offset in ((dk, 0), (dk, dk), (ratio * dv, 2 * dk)):  # q, k, v
        for h in range(num_k_heads):
            cols.extend(h * w + offset + np.arange(0, width, run))
    return np.asarray(cols, np.int32)


def split_block_c(widths: tuple[int, ...], requested: int = BLOCK_C) -> int | None:
    """The channel tile of :func:`causal_conv1d_prefill_split`: the largest power of two up to
    ``requested`` dividing every input's width but the last (a tile then lies in one input),
    at least 8 (a Triton vector), else None (the packed path)."""
    b = requested
    while b >= 8:
        if all(n % b == 0 for n in widths[:-1]):
            return b
        b //= 2
    return None


def causal_conv1d_prefill_split(
    xs: tuple[jax.Array, ...],  # [T, n_i]: the channels in turn (a layer's q, k, v)
    weight: jax.Array,  # [C, K]  C = sum n_i
    conv_state: jax.Array,  # [num_slots, K-1, C]  donated: updated in place
    query_start_loc: jax.Array,  # i32[S+1]
    slots: StateSlots,  # DESIGN.md §3
    *,
    block_t: int = BLOCK_T,
    block_c: int = BLOCK_C,
    num_warps: int = 2,
    num_stages: int = 1,
    interpret: bool = False,
) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """:func:`causal_conv1d_prefill` of channels held in several arrays (a Kimi-Linear layer's
    q, k, v projections), each read where it is and its output written apart: ``(ys,
    conv_state)``, one ``[T, n_i]`` output per input. No concatenation before the conv nor
    slices after it; the same windows and arithmetic as the packed call (bit for bit).

    A channel tile lies in one input: ``block_c`` is cut to the largest power of two dividing
    every width but the last (:func:`split_block_c`); when that is under 8, XLA packs the inputs
    around :func:`causal_conv1d_prefill` instead, with one log line."""
    check_split_args(xs, weight)
    widths = tuple(x.shape[1] for x in xs)
    _check_blocks(block_t, block_c)
    tiles = dict(block_t=block_t, block_c=block_c, num_warps=num_warps, num_stages=num_stages)
    bc = split_block_c(widths, block_c)
    if bc is None:
        _log_packed_inputs(widths)
        conv = functools.partial(causal_conv1d_prefill, interpret=interpret, **tiles)
        return packed_inputs(conv)(xs, weight, conv_state, query_start_loc, slots)
    n = xs[0].shape[0]
    check_conv1d_args(jax.ShapeDtypeStruct((n, weight.shape[0]), xs[0].dtype), weight, conv_state,
                      slots, query_start_loc)  # fmt: skip
    *ys, conv_state = _launch_prefill(
        xs, None, weight, conv_state, query_start_loc, slots, run=None, splits=widths,
        block_t=min(block_t, _pow2_at_least(n)), block_c=min(bc, _pow2_at_least(sum(widths))),
        num_warps=num_warps, num_stages=num_stages, interpret=interpret,
    )  # fmt: skip
    return tuple(ys), conv_state


@functools.cache
def _log_packed_inputs(widths: tuple[int, ...]) -> None:
    log.warning(
        "causal_conv1d_prefill_split: packed path (XLA concatenates the inputs around the conv "
        "kernel) for input widths %s: no power-of-two tile of >= 8 channels divides them",
        widths,
    )


# A tile of the in-place call is unrolled run by run (its loads, the table lookups, the
# stores into the splits): its channels are cut to at most this many runs, or the Triton
# kernel grows with BC / run (16 runs of 16 channels in a 256-channel tile took minutes to
# compile on an H200).
MAX_RUNS_PER_TILE = 4


def qkvz_run(dk: int, dv: int, ratio: int, block_c: int = BLOCK_C) -> int | None:
    """The contiguous run of :func:`causal_conv1d_prefill_qkvz`'s reads: the largest power of
    two up to ``block_c`` dividing ``Dk`` and ``r Dv``, at least 8 (a Triton vector), else
    None (the packed path)."""
    run = block_c
    while run >= 8:
        if dk % run == 0 and (ratio * dv) % run == 0:
            return run
        run //= 2
    return None


def causal_conv1d_prefill_qkvz(
    qkvz: jax.Array,  # [T, Hk * (2 Dk + 2 r Dv)]  the GDN input projection's output
    weight: jax.Array,  # [C, K]  C = 2 Hk Dk + Hv Dv, channels q | k | v
    conv_state: jax.Array,  # [num_slots, K-1, C]  donated: updated in place
    query_start_loc: jax.Array,  # i32[S+1]
    slots: StateSlots,  # DESIGN.md §3
    *,
    num_k_heads: int,
    head_dims: tuple[int, int],  # (Dk, Dv)
    block_t: int = BLOCK_T,
    block_c: int = BLOCK_C,
    num_warps: int = 2,
    num_stages: int = 1,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """:func:`causal_conv1d_prefill` of a GDN layer's ``q | k | v`` read where its input
    projection leaves them (no packing pass before the conv) and handed back apart (no
    slicing pass after it): ``(q [T, Hk Dk], k [T, Hk Dk], v [T, Hv Dv], conv_state)``. The
    same windows, checkpoints and arithmetic as the packed call (bit for bit).

    A channel tile holds at most ``MAX_RUNS_PER_TILE`` runs (``block_c`` is cut to that).
    Heads whose ``Dk`` and ``r Dv`` share no power-of-two run of at least 8 channels (a Triton
    vector, :func:`qkvz_run`) take the packed path instead (XLA's packing,
    :func:`causal_conv1d_prefill`, XLA's slices), with one log line."""
    hk, (dk, dv) = num_k_heads, head_dims
    ratio = check_qkvz_args(qkvz, weight, hk, head_dims)
    _check_blocks(block_t, block_c)
    run = qkvz_run(dk, dv, ratio, block_c)
    tiles = dict(block_t=block_t, block_c=block_c, num_warps=num_warps, num_stages=num_stages)
    if run is None:
        _log_packed(head_dims, ratio)
        packed = packed_qkvz(functools.partial(causal_conv1d_prefill, interpret=interpret, **tiles))
        return packed(qkvz, weight, conv_state, query_start_loc, slots, num_k_heads=hk,
                      head_dims=head_dims)  # fmt: skip
    check_conv1d_args(
        jax.ShapeDtypeStruct((qkvz.shape[0], weight.shape[0]), qkvz.dtype), weight, conv_state,
        slots, query_start_loc,
    )  # fmt: skip
    bt = min(block_t, _pow2_at_least(qkvz.shape[0]))
    bc = min(block_c, MAX_RUNS_PER_TILE * run)
    return _launch_prefill(
        (qkvz,), qkvz_columns(hk, dk, dv, ratio, run), weight, conv_state, query_start_loc, slots,
        run=run, splits=(hk * dk, hk * dk, hk * ratio * dv), block_t=bt, block_c=bc,
        num_warps=num_warps, num_stages=num_stages, interpret=interpret,
    )  # fmt: skip


@functools.cache
def _log_packed(head_dims: tuple[int, int], ratio: int) -> None:
    log.warning(
        "causal_conv1d_prefill_qkvz: packed path (XLA packs q | k | v around the conv kernel) "
        "for head dims %s with %d value heads a key head: no power-of-two run of >= 8 "
        "channels divides Dk and r Dv",
        head_dims, ratio,
    )  # fmt: skip


# ----------------------------------------------------------------------------- decode update

UPDATE_BLOCK_C = 256
UPDATE_NUM_WARPS = 2


def update_block_c(splits: tuple[int, ...], requested: int = UPDATE_BLOCK_C) -> int | None:
    """The largest power of two up to ``requested`` dividing every split, at least 8 (a
    Triton vector), else None: :func:`causal_conv1d_update` cannot take the channels."""
    b = requested
    while b >= 8:
        if all(n % b == 0 for n in splits):
            return b
        b //= 2
    return None


def _update_kernel(
    p: DecodeSlots,
    x_ref,  # [S, C]
    w_ref,  # [C, K]
    conv_in,  # [num_slots, K-1, C]
    *refs,  # the outputs (one per split), then conv_out (aliased to conv_in)
    bc: int,
    splits: tuple[int, ...],
):
    r, c = pl.program_id(0), pl.program_id(1)
    *outs, conv_out = refs
    live = r < p.num_seqs[0]
    cs = pl.ds(c * bc, bc)
    window = window_of(conv_in, x_ref, r, p.src[r], live, cs, bc)
    y = jnp.where(live, silu_conv(window, w_ref, cs, bc), 0.0)
    shift_window(conv_out, window, row_writes(p, r, live), cs, bc)
    first = 0
    for out, n in zip(outs, splits, strict=True):  # the split holding this block

        @pl.when((c * bc >= first) & (c * bc < first + n))
        def _(out=out, first=first):
            out[r, pl.ds(c * bc - first, bc)] = y.astype(out.dtype)

        first += n


def causal_conv1d_update(
    x: jax.Array,  # [S, C] one new token per row
    weight: jax.Array,  # [C, K]
    conv_state: jax.Array,  # [num_slots, K-1, C]  donated: updated in place
    slots: StateSlots,  # DESIGN.md §3
    *,
    splits: tuple[int, ...] | None = None,
    block_c: int = UPDATE_BLOCK_C,
    num_warps: int = UPDATE_NUM_WARPS,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """Decode; see the module docstring. Returns ``(y [S, C], conv_state)``, or with
    ``splits`` (channel counts summing to ``C``) ``(*ys [S, n], conv_state)``."""
    check_conv1d_args(x, weight, conv_state, slots)
    rows, c = x.shape
    if rows != slots.num_rows:
        raise ValueError(f"decode rows {rows} must equal {slots.num_rows=} (one token each)")
    parts = (c,) if splits is None else tuple(splits)
    if sum(parts) != c:
        raise ValueError(f"splits {parts} must sum to the {c} channels")
    bc = update_block_c(parts, block_c)
    if bc is None:
        raise ValueError(f"conv channels {parts}: no power-of-two tile of >= 8 divides them all")
    args = (*slots.arrays(), x, weight, conv_state)
    return tuple(
        pl.pallas_call(
            group_refs(functools.partial(_update_kernel, bc=bc, splits=parts), DecodeSlots),
            grid=(rows, c // bc),
            out_shape=[
                *(jax.ShapeDtypeStruct((rows, n), x.dtype) for n in parts),
                jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
            ],
            input_output_aliases={len(args) - 1: len(parts)},
            compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
            interpret=interpret,
            name="causal_conv1d_update_gpu",
        )(*args)
    )
