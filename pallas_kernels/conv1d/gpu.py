"""Causal depthwise conv1d + SiLU Pallas kernel for NVIDIA GPUs (Triton lowering), with slots.

Same signature and semantics as :func:`pallas_kernels.conv1d.reference.
causal_conv1d_prefill_reference` (DESIGN.md §3). Written for memory bandwidth: every input is
read once from HBM and every output written once; the taps are summed in float32.

Prefill, one launch, grid = (W + ceil(T / BT), ceil(C / BC))
-------------------------------------------------------------
The first ``W = S * (M + 1)`` programs along axis 0 write the conv windows (one per row and
target: the ``M`` checkpoints, then ``dst``); the others each own a ``[BT, BC]`` tile of
tokens x channels. A token program finds the row of each of its tokens by a binary search
over ``query_start_loc`` (no per-token lookup table, no extra launch), then sums the ``K``
taps, each a ``[BT, BC]`` load of the rows ``d = K-1 .. 0`` above (all but one of them hit the
cache). A tap of a token whose position in its sequence is negative reads the source window
instead::

    K = 4, a sequence starting at token 5 with window p0 p1 p2 (zeros when src == 0)

    token t:        5   6   7   8 ...        pos = t - qsl[row] + j - (K-1)
    tap j = 0:      p0  p1  p2  x5           pos < 0: init[row, K-1 + pos]
    tap j = 1:      p1  p2  x5  x6           pos >= 0: x[t + j - (K-1)]
    tap j = 2:      p2  x5  x6  x7
    tap j = 3:      x5  x6  x7  x8           y[t] = silu(sum_j w[:, j] * tap_j[t])

A window program writes ``[K-1, BC]`` rows ``off - (K-1) .. off - 1`` of its row (from ``x``,
or from the source window where negative) to its slot; ``off`` is the checkpoint's offset, or
the row's length for ``dst``. Nothing else is written to the pool.

Reads before writes: the source windows of all rows are gathered (``read_slots``, one small
XLA fusion of ``S * (K-1) * C`` elements) before the launch, and the kernel reads that copy,
never the pool. So a row that updates its slot in place (``src == dst``) cannot see its new
window: the programs of one launch run in no fixed order, and a token program reading
``pool[src]`` could otherwise run after the window program that overwrote it.

Any ``C`` (channel tiles are masked), any ``K`` in [2, 9], any dtypes the reference takes.
``interpret=True`` runs the kernel in Pallas' interpreter on CPU (the tests). Loads that may
leave the array (a tap above the first token, the last partial tile) index with clamped
integer arrays, stores with slices: the interpreter clamps a negative slice start (shifting
the data), and resolves a clamped duplicate index of a masked store in no fixed order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common.ragged import read_slots
from pallas_kernels.common.slots import StateSlots
from pallas_kernels.conv1d.reference import check_conv1d_args

BLOCK_T = 64
BLOCK_C = 128


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
    x_ref,  # [T, C]
    w_ref,  # [C, K]
    init_ref,  # [S, K-1, C]  the source windows (zeros where src == 0)
    pool_in,  # [num_slots, K-1, C]  aliased to pool_out; never read
    y_ref,  # [T, C]
    pool_out,  # [num_slots, K-1, C]
    *, block_t: int, block_c: int,
):  # fmt: skip
    del pool_in
    num_tokens, c = x_ref.shape
    kw = w_ref.shape[1]
    km1 = kw - 1
    rows, max_ckpt = ck_off_ref.shape
    num_windows = rows * (max_ckpt + 1)
    pid, cb = pl.program_id(0), pl.program_id(1)
    cols = cb * block_c + jax.lax.broadcasted_iota(jnp.int32, (1, block_c), 1)  # [1, BC]
    col_ok = cols < c
    c0 = pl.ds(cb * block_c, block_c)
    f32 = jnp.float32

    def tap_x(tok, ok):
        """``x[tok, cols]`` in f32 where ``ok`` (zeros elsewhere, nothing read)."""
        tok = jnp.clip(tok, 0, num_tokens - 1)
        return pltr.load(x_ref.at[tok, cols], mask=ok & col_ok, other=0).astype(f32)

    def tap_init(row, pos, ok):
        """``init[row, K-1 + pos, cols]`` (``pos`` in [-(K-1), 0)) in f32 where ``ok``."""
        r = jnp.clip(km1 + pos, 0, km1 - 1)
        return pltr.load(init_ref.at[row, r, cols], mask=ok & col_ok, other=0).astype(f32)

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
        ok = (i < km1) & (s < nseq_ref[0]) & (slot > 0)
        win = tap_x(start + pos, ok & (pos >= 0)) + tap_init(s, pos, ok & (pos < 0))
        pltr.store(
            pool_out.at[slot, pl.ds(0, kp), c0],
            win.astype(pool_out.dtype),
            mask=ok & col_ok,
        )

    @pl.when(pid >= num_windows)
    def _():
        t0 = (pid - num_windows) * block_t
        t = t0 + jax.lax.broadcasted_iota(jnp.int32, (block_t, 1), 0)  # [BT, 1] tokens
        live = t < qsl_ref[nseq_ref[0]]  # padding tokens give 0
        row = _row_of(qsl_ref, t, rows)
        local = t - pltr.load(qsl_ref.at[row])  # index in the row's new tokens
        acc = jnp.zeros((block_t, block_c), f32)
        for j in range(kw):  # same order of sums as the reference
            d = j - km1
            pos = local + d
            v = tap_x(t + d, live & (pos >= 0))
            if d < 0:
                v = v + tap_init(row, pos, live & (pos < 0))
            wj = pltr.load(w_ref.at[cols, j], mask=col_ok, other=0).astype(f32)  # [1, BC]
            acc = v * wj if j == 0 else acc + v * wj
        y = jnp.where(live, _silu(acc), 0.0)
        pltr.store(
            y_ref.at[pl.ds(t0, block_t), c0],
            y.astype(y_ref.dtype),
            mask=(t < num_tokens) & col_ok,
        )


def causal_conv1d_prefill(
    x: jax.Array,  # [T, C] pre-conv inputs, model dtype
    weight: jax.Array,  # [C, K]
    conv_state: jax.Array,  # [num_slots, K-1, C]  donated: updated in place
    query_start_loc: jax.Array,  # i32[S+1]
    slots: StateSlots,  # DESIGN.md §3
    *,
    block_t: int = BLOCK_T,
    block_c: int = BLOCK_C,
    num_warps: int = 4,
    num_stages: int = 1,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Ragged prefill; see the module docstring. Returns ``(y [T, C], conv_state)``.

    Writes the window after the last token to ``dst_slot`` and after ``ckpt_offsets`` tokens
    to ``ckpt_slots`` for live rows; padding tokens give 0. ``block_t`` and ``block_c`` (powers
    of two) are the token x channel tile, shrunk to the problem when it is smaller.
    """
    check_conv1d_args(x, weight, conv_state, slots, query_start_loc)
    for name, b in (("block_t", block_t), ("block_c", block_c)):
        if b < 1 or b & (b - 1):
            raise ValueError(f"{name}={b} must be a power of two")
    n, c = x.shape
    rows, max_ckpt = slots.ckpt_offsets.shape
    bt = min(block_t, _pow2_at_least(n))
    bc = min(block_c, _pow2_at_least(c))
    num_windows = rows * (max_ckpt + 1)
    src, dst, ck_off, ck_slot, num_seqs = slots.arrays()
    init = read_slots(conv_state, src)  # [S, K-1, C], read before the pool is written
    args = (query_start_loc.astype(jnp.int32), num_seqs, dst, ck_off, ck_slot, x, weight, init,
            conv_state)  # fmt: skip
    return pl.pallas_call(
        functools.partial(_prefill_kernel, block_t=bt, block_c=bc),
        grid=(num_windows + pl.cdiv(n, bt), pl.cdiv(c, bc)),
        out_shape=[
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
        ],
        input_output_aliases={len(args) - 1: 1},
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="causal_conv1d_prefill_gpu",
    )(*args)
