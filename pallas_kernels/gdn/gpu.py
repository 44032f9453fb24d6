"""Gated delta rule Pallas kernels for NVIDIA GPUs (Triton lowering), with explicit slots.

Same signatures and semantics as :mod:`pallas_kernels.gdn.reference` (DESIGN.md §3). The
kernels use ``jax.experimental.pallas.triton`` (masked loads/stores, ``tl.dot``); JAX 0.11
marks that lowering deprecated in favour of Mosaic GPU, but it is the one that compiles these
ragged, masked access patterns today. ``interpret=True`` runs them with Pallas' generic
interpreter on CPU (how the indexing logic is tested here); nothing below is tuned yet. Tiles,
slot loads and stores, the decode program, the prefill windows and the row scan are
:mod:`pallas_kernels.common.delta_rule_gpu`'s (shared with the KDA kernels); the chunk math is
:mod:`pallas_kernels.common.delta_rule`'s. What is GDN's: one gate per value head (a scalar
decay), GVA (value head ``h`` reads key head ``h // (Hv // Hk)``), 64-token chunks, and a
prefill split into a parallel and a serial launch.

The pool holds each state transposed, ``[num_slots, Hv, Dv, Dk]`` (DESIGN.md §3).

Decode
------
grid = (S * Dv / BV, Hv); a program owns ``state[slot, h, v0:v0+BV, :]`` of one row (a
contiguous ``[BV, Dk]`` tile, by default 16 rows on one warp) and decays it by ``exp(g)``,
``g = -exp(A_log) softplus(a + dt_bias)``
(:func:`~pallas_kernels.common.delta_rule_gpu.decode_program`).

Prefill (chunked WY/UT form, two or three launches)
---------------------------------------------------
Chunks of at most 64 tokens, each read as a 64-row window (``T >= 64``: the wrapper pads
shorter batches).

1. ``_intra_kernel``, grid = (NC, Hv), every chunk in parallel: all of the chunk that does not
   depend on the state. Gates, ``gam = cumsum(g)``, ``A = beta k k^T * decay`` (strictly
   lower), ``Tm = (I + A)^-1`` by recursive doubling, ``W = Tm (beta e^gam k)``,
   ``U = Tm (beta v)``, the decayed rows ``q e^gam`` and ``k e^(gam_last - gam)``, the
   intra-chunk scores ``Aqk = incl_lower(q k^T * decay)`` and the chunk's state decay
   ``e^gam_last``. Stored head-major (``[Hv, T, D]``: a chunk's rows are contiguous) in the
   *operand dtype*, valid rows only, so the scratch is proportional to the tokens. This
   launch was most of a prefill's time on an H200 in this whole-chunk form (84-86 % at
   1x16384 and 8x4096, BENCHMARKS.md: 255 registers a thread, one program an SM); its other
   forms (``intra_form``: :data:`INTRA_FORMS`) are the same outputs by 16-row blocks
   (``_intra_kernel_blocked``, with f32 or bf16 products) or in two launches with ``Tm``
   stored between them (``_intra_kernel_scores``, ``_intra_kernel_wu``). A bf16 model's
   prefill runs the blocked one with bf16 products at 4 warps (:func:`default_intra_form`,
   :data:`INTRA_TUNING`: 2.1x the whole chunk's launch at 8x4096).
2. The serial launch (:mod:`pallas_kernels.common.chunk_scan_gpu`, shared with KDA), one
   program per (row, value head, Dv block), the blocks on the fastest grid axis
   (``serial_grid``; BV 64 when that fills the SMs, else 32: ``serial_block_v``): a program
   walks its row's chunks in order with ``S [Dk, BV]`` (f32) in registers (transposed from and
   to the pool's ``[BV, Dk]`` rows): ``V' = U - W S``, ``o = (q e^gam) S + Aqk V'``,
   ``S = e^gam_last S + (k e^(gam_last - gam))^T V'``, writing checkpoints and ``dst``. Two of
   the four products (``W S``, then the state update) are the serial chain; the other two hang
   off it.

``fold`` (the default where it can run, :data:`FOLD`: the Mosaic GPU serial launch and a
blocked intra form; ``gdn_prefill(fold=False)`` or ``HYJAX_GDN_FOLD=0`` turn it off): the
intra launch reads no v and stores neither ``U``, ``q_dec``, ``k_dec`` nor ``Aqk`` (its q.k
and U products gone) but W, U's factor ``Tm diag(beta)`` (``[64, 64]`` a chunk) and five
per-token vectors (:data:`FOLD_VECTORS`): at 8x4096 ~0.55 GB written instead of ~1.2. The
serial launch reads v's, q's and k's own rows and makes U (in the accumulator of ``S^T W^T``),
``Aqk`` (one more ``wgmma`` a chunk) and the rows' scalings itself
(``chunk_scan_mgpu._fold_step``). By default (:data:`FOLD_INTRA`) that scratch is made not by
this module's intra launch but by XLA and a Mosaic GPU launch (:mod:`.intra_mgpu`: the inverse
by ``wgmma`` doubling steps), the intra launch's place taken.

``three_launches`` moves the output out of the serial launch into a parallel one (each chunk's
starting state stored, ``[NC, Hv, Dk, Dv]`` in the operand dtype): a shorter serial chain, for
a scratch that grows with the chunks; not the default (slower at every measured shape).

The operand dtype (:func:`operand_dtype_for`) is that of the products' inputs after the UT
transform: bf16 for bf16 activations (FLA's and FlashInfer's choice: bf16 tensor-core products,
f32 accumulation, the state kept in f32 between chunks), f32 for f32 ones (the products then
follow ``precision``). In the ``"whole"`` and ``"blocked"`` forms the UT transform itself
(``k k^T``, the inverse, W, U) runs on f32 operands at ``precision``; in ``"blocked_bf16"`` (a
bf16 model's default) the scores, W and U are bf16 products and the inverse f32 at
``precision``, as FLA's ``chunk_gated_delta_rule``.
Requirements: ``Dk`` a power of two, ``BV`` a power of two dividing ``Dv`` (by default the
largest one up to 32 or 64); :func:`unsupported_reason` says which head dims ``hyjax.ops``
must leave to the reference.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common import chunk_scan_mgpu, decode_mgpu
from pallas_kernels.common.chunk_scan_gpu import ChunkRefs, chunk_refs_shapes, scan_launches
from pallas_kernels.common.chunking import live_end, max_chunks, plan_chunks
from pallas_kernels.common.delta_rule import (
    NT,
    block_unit_lower_inverse,
    l2norm,
    softplus,
    unit_lower_inverse,
)
from pallas_kernels.common.delta_rule_gpu import (
    DECODE_BLOCK_V,
    DECODE_NUM_WARPS,
    SERIAL_VB_FIRST,
    DecodeSlots,
    check_key_dim,
    compiler_params,
    decode_program,
    launch_decode,
    load_v_blocks,
    operand_dtype_for,
    operand_products,
    pad_tokens,
    pick_block_v,
    row_plan,
    serial_block_v,
    store_blocked_w_u,
    sub_rows,
    window,
)
from pallas_kernels.common.delta_rule_gpu import unsupported_reason as unsupported_reason
from pallas_kernels.common.slots import StateSlots
from pallas_kernels.gdn import intra_mgpu
from pallas_kernels.gdn.reference import check_gdn_args

CHUNK = 64
SUB = 16  # the blocked intra launch's sub-blocks (_intra_kernel_blocked)
NSUB = CHUNK // SUB
# The intra launch's forms (:func:`intra_launch`): the whole chunk's tiles (_intra_kernel;
# "whole_bf16": its scores, W and U bf16 products, 64-row dots), or by 16-row blocks
# (_intra_kernel_blocked) with f32 operands at the prefill's precision or bf16 ones (the
# products' operands rounded as FLA's chunk kernels do; the inverse f32), or split in two
# launches, Tm stored between them (_intra_kernel_scores, _intra_kernel_wu), its first by
# blocks in "split_blocked" (_intra_kernel_blocked_scores), and with bf16 products in both
# launches in "split_blocked_bf16" (as FLA's kernels split and round them).
INTRA_FORMS = (
    "whole", "whole_bf16", "blocked", "blocked_bf16", "split", "split_blocked",
    "split_blocked_bf16",
)  # fmt: skip
# The form a prefill runs when not told (``intra_form=None``; HYJAX_GDN_INTRA=<form> for a
# process): :func:`default_intra_form`.
INTRA_FORM = os.environ.get("HYJAX_GDN_INTRA") or None
# gdn_prefill's fold when not told (fold=None; HYJAX_GDN_FOLD=0 for a process: off). On where
# it can run (the Mosaic GPU serial launch, a blocked intra form): on an H200 (2026-11-30,
# BENCHMARKS.md) the prefill at 2x4096, 4x4096 and 8x4096 took 0.615 / 1.031 / 1.978 ms
# against the unfolded 0.640 / 1.230 / 2.338 (the intra launch 1.28 ms against 1.71 at
# 8x4096); at one row, whose 64 serial programs leave half the SMs idle, the longer serial
# chain costs about what the intra launch saves (0.85-1.01x at 1x4096 in four processes).
FOLD = os.environ.get("HYJAX_GDN_FOLD", "1") == "1"
# The fold's intra launch with beta moved to the rows: Tm diag(beta) = diag(beta) M^-1 for
# M = I + L diag(beta) (L the chunk's strictly lower k k^T e^(gam_i - gam_j); the push-through
# identity (I + B L)^-1 B = B (I + L B)^-1), L diag(beta)'s column scale folded into its
# exponent (e^(gam_i - gam_j + log beta_j)) and the inverse's rows scaled by beta: no column
# scaling of a [16, 16] block (Triton moves it between layouts). Offline (ptxas, 4 warps):
# 4,720 SASS instructions against 4,856, 0 or 4 bytes of spills (the source's line numbers
# alone move it; the inverse's blocks scaled once instead of where stored and in W: 4,640).
# On an H200 (2026-11-30, BENCHMARKS.md) the intra launch alone took 1.178 ms against 1.256 at
# 8x4096 and the prefill 1.855 against 1.966 (0.433 against 0.424 at 1x4096): on by default,
# HYJAX_GDN_FOLD_BETA_ROWS=0 for the columns' scaling (gdn_kernels' "foldcols" variant).
FOLD_BETA_ROWS = os.environ.get("HYJAX_GDN_FOLD_BETA_ROWS", "1") == "1"
# Who makes the fold's scratch: "mgpu" (XLA's per-token vectors and a Mosaic GPU launch,
# pallas_kernels.gdn.intra_mgpu: the inverse by wgmma doubling steps; shapes it cannot take
# fall back with one log line) or "triton" (this module's intra launch, _intra_kernel_fold).
# H200, 2026-11-30 (BENCHMARKS.md): the launch 0.50 ms (traced, two heads a program) against
# 1.05 at 8x4096, the prefill 1.23 against 1.83 ms. HYJAX_GDN_FOLD_INTRA=triton for a process.
FOLD_INTRA = os.environ.get("HYJAX_GDN_FOLD_INTRA", "mgpu")
# With the Mosaic GPU scratch: each chunk's Aqk made there too (one more product on q's block,
# an 8 KB tile a chunk and head), so that the serial launch neither issues q k^T nor makes Aqk
# (the elementwise work its profile shows unhidden, ~1,400 of 4,779 cycles a chunk). Not yet
# timed: off by default, HYJAX_GDN_FOLD_AQK=1 for a process (gdn_kernels' "foldaqk").
FOLD_AQK = os.environ.get("HYJAX_GDN_FOLD_AQK", "0") == "1"
# Each form's (warps, stages) when not told: the fastest of the intra launch alone at 8x4096
# on an H200 (gdn_kernels --intra-sweep, BENCHMARKS.md: blocked_bf16 1.79 ms at 4 warps, 3.03
# at 8; the whole chunk's 3.81 at 8, 5.29 at 4; whole_bf16 2.04 at 4, 2.93 at 8;
# split_blocked_bf16 2.22 at 4, 3.25 at 8, 3.48 at 2).
INTRA_TUNING = {
    "whole": (8, 2), "blocked": (2, 1), "blocked_bf16": (4, 2), "split": (4, 2),
    "split_blocked": (4, 2), "whole_bf16": (4, 2), "split_blocked_bf16": (4, 2),
}  # fmt: skip


def default_intra_form(operand_dtype) -> str:
    """:data:`INTRA_FORM` if set, else by the operands: 16-bit ones (a bf16 model's) by 16-row
    blocks with bf16 products and the inverse at the prefill's precision, as FLA's chunk
    kernels (2.1x the whole chunk's launch at 8x4096 on an H200); f32 ones the whole chunk's
    at the prefill's precision (an f32 model's products stay f32; the f32 blocked form is
    slower, 5.2 ms against 3.8)."""
    if INTRA_FORM is not None:
        return INTRA_FORM
    return "whole" if jnp.dtype(operand_dtype) == jnp.float32 else "blocked_bf16"


def _gates(alog_ref, dtb_ref, h, a, b):
    """``g = -exp(A_log) softplus(a + dt_bias)`` and ``beta = sigmoid(b)`` for value head h."""
    neg_a = -jnp.exp(alog_ref[h].astype(jnp.float32))
    g = neg_a * softplus(a.astype(jnp.float32) + dtb_ref[h].astype(jnp.float32))
    return g, jax.nn.sigmoid(b.astype(jnp.float32))


def token_inputs(
    alog_ref, dtb_ref, q_ref, k_ref, v_ref, a_ref, b_ref, tok, h, vs, *, ratio, scale
):  # fmt: skip
    """One token's decode inputs for value head ``h`` and Dv columns ``vs`` (the decode and
    multi-token decode kernels): ``(q, k [Dk], v [BV], beta, decay = exp(g))``."""
    q = l2norm(q_ref[tok, h // ratio, :].astype(jnp.float32)) * scale  # [Dk]
    k = l2norm(k_ref[tok, h // ratio, :].astype(jnp.float32))
    v = v_ref[tok, h, vs].astype(jnp.float32)  # [BV]
    g, beta = _gates(alog_ref, dtb_ref, h, a_ref[tok, h], b_ref[tok, h])
    return q, k, v, beta, jnp.exp(g)


# ----------------------------------------------------------------------------- decode


def _decode_kernel(
    p: DecodeSlots,
    alog_ref, dtb_ref,  # f32[Hv]: A_log, dt_bias (the gates computed in the kernel)
    q_ref, k_ref,  # [S, Hk, Dk]
    v_ref,  # [S, Hv, Dv]
    a_ref, b_ref,  # [S, Hv]
    pool_in,  # f32 | bf16[num_slots, Hv, Dv, Dk]
    o_ref,  # [S, Hv, Dv]
    pool_out,  # aliased to pool_in
    *, bv: int, ratio: int, scale: float,
):  # fmt: skip
    refs = (alog_ref, dtb_ref, q_ref, k_ref, v_ref, a_ref, b_ref)
    inputs = functools.partial(token_inputs, *refs, ratio=ratio, scale=scale)
    decode_program(p, pool_in, o_ref, pool_out, bv=bv, inputs=inputs)


def gdn_decode(
    q: jax.Array,  # [S, Hk, Dk]
    k: jax.Array,  # [S, Hk, Dk]
    v: jax.Array,  # [S, Hv, Dv]
    a: jax.Array,  # [S, Hv]
    b: jax.Array,  # [S, Hv]
    A_log: jax.Array,  # f32[Hv]
    dt_bias: jax.Array,  # f32[Hv]
    state: jax.Array,  # f32 | bf16[num_slots, Hv, Dv, Dk]  donated: updated in place
    slots: StateSlots,  # DESIGN.md §3
    *,
    block_v: int | None = None,
    num_warps: int = DECODE_NUM_WARPS,
    num_stages: int = 1,
    kernel: str | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """One token per row; see the module docstring. ``kernel``: ``"triton"``, ``"mgpu"`` (the
    Mosaic GPU decode, :mod:`pallas_kernels.common.decode_mgpu`) or None
    (``decode_mgpu.DECODE_DEFAULT``). Returns ``(o [S, Hv, Dv], state)``."""
    check_gdn_args(q, k, v, a, b, A_log, dt_bias, state, slots)
    rows, hk, dk = q.shape
    _, hv, dv = v.shape
    if rows != slots.num_rows:
        raise ValueError(f"decode rows {rows} must equal {slots.num_rows=} (one token each)")
    check_key_dim(dk)
    if decode_mgpu.decode_is_mgpu(kernel, state, slots, 2, interpret):
        return decode_mgpu.gdn_decode_mgpu(
            q, k, v, a, b, A_log, dt_bias, state, slots, interpret=interpret
        )
    return launch_decode(
        _decode_kernel,
        name="gdn_decode_gpu",
        slots=slots,
        inputs=(A_log, dt_bias, q, k, v, a, b),
        state=state,
        out_dtype=v.dtype,
        bv=pick_block_v(dv, block_v, default=DECODE_BLOCK_V),
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        ratio=hv // hk,
        scale=float(dk) ** -0.5,
    )


# ----------------------------------------------------------------------------- prefill


def _intra_kernel(
    c_start_ref, c_len_ref,  # i32[NC]
    live_ref,  # i32[1]  the batch's token count (tma_layout: k_dec's rows after it are zeroed)
    alog_ref, dtb_ref,  # f32[Hv]
    q_ref, k_ref,  # [Tp, Hk, Dk]
    v_ref,  # [Tp, Hv, Dv]
    a_ref, b_ref,  # [Tp, Hv]
    w_ref,  # [Hv, Tp, Dk]  out: W = Tm (beta e^gam k), head-major, valid rows only
    u_ref,  # [Hv, Tp, Dv]  out: U = Tm (beta v)  (tma_layout: U^T, [Hv, Dv, Tp])
    qd_ref,  # [Hv, Tp, Dk] out: q e^gam (l2-normed, scaled)
    kd_ref,  # [Hv, Tp, Dk] out: k e^(gam_last - gam) (l2-normed)
    aqk_ref,  # [Hv, Tp, C] out: incl_lower(q k^T e^(gam_i - gam_j)), window columns
    dl_ref,  # f32[NC, Hv]  out: e^gam_last, the chunk's state decay
    *, ratio: int, scale: float, precision, tma_layout: bool = False, bf16_products: bool = False,
):  # fmt: skip
    """Kernel 1, one program per (chunk, value head), all in parallel: everything of the chunk
    that does not depend on the state (the gates, the UT transform, the decayed q / k rows and
    the intra-chunk scores), so the serial launch does only the state's products.
    ``tma_layout``: the scratch the Mosaic GPU serial launch reads
    (:mod:`pallas_kernels.common.chunk_scan_mgpu`): a token-aligned plan's chunks, each read in
    the 64-token block of the batch it lies in, ``U`` transposed, and ``k_dec`` zero on the
    block's rows after the batch's last token, which no chunk writes. ``bf16_products``
    (``"whole_bf16"``): the scores, W and U as bf16 MMAs, the inverse f32 at ``precision``."""
    prod = _products(precision, bf16_products)

    def body(ci, h, win):
        x = _chunk_rows(win, h, h // ratio, scale, alog_ref, dtb_ref, k_ref, a_ref, b_ref, q_ref)
        tm = unit_lower_inverse(_kk_scores(x, prod), precision)
        _store_w_u(x, win, h, tm, prod, v_ref, w_ref, u_ref, tma_layout)
        _store_q_k_rows(x, win, h, prod, live_ref, qd_ref, kd_ref, aqk_ref, tma_layout)
        dl_ref[ci, h] = jnp.exp(x.gam_last)

    _chunk_program(c_start_ref, c_len_ref, k_ref.shape[0], tma_layout, body)


def _chunk_program(c_start_ref, c_len_ref, num_tokens: int, tma_layout: bool, body) -> None:
    """An intra launch's program (chunk ``ci``, value head ``h``): ``body(ci, h, window)`` on
    a chunk with tokens (the plan's padding chunks have none)."""
    ci, h = pl.program_id(0), pl.program_id(1)
    start, length = c_start_ref[ci], c_len_ref[ci]

    @pl.when(length > 0)
    def _():
        body(ci, h, window(start, length, num_tokens, CHUNK, aligned=tma_layout))


class _ChunkRows(NamedTuple):
    """A chunk's rows in its 64-row window (rows outside the chunk: zeros, ``g = beta = 0``)."""

    k: jax.Array  # f32[C, Dk]  l2-normed
    q: jax.Array | None  # f32[C, Dk]  l2-normed, scaled
    beta: jax.Array  # f32[C]
    gam: jax.Array  # f32[C]  cumsum of g from the window's first row (non-increasing)
    gam_last: jax.Array  # f32[]


def _chunk_rows(win, h, hk, scale, alog_ref, dtb_ref, k_ref, a_ref, b_ref, q_ref=None):
    valid = win.valid
    k = pltr.load(k_ref.at[win.rows, hk, :], mask=valid[:, None], other=0.0)
    k = l2norm(k.astype(jnp.float32))
    q = None
    if q_ref is not None:
        q = pltr.load(q_ref.at[win.rows, hk, :], mask=valid[:, None], other=0.0)
        q = l2norm(q.astype(jnp.float32)) * scale
    a = pltr.load(a_ref.at[win.rows, h], mask=valid, other=0.0)
    b = pltr.load(b_ref.at[win.rows, h], mask=valid, other=0.0)
    g, beta = _gates(alog_ref, dtb_ref, h, a, b)
    g = jnp.where(valid, g, 0.0)
    return _ChunkRows(k, q, jnp.where(valid, beta, 0.0), jnp.cumsum(g), jnp.sum(g))


def _decays(x: _ChunkRows, inclusive: bool):
    """``e^(gam_i - gam_j)`` below the diagonal (on it too with ``inclusive``), 0 above: every
    exponent kept is <= 0 (gam never increases), so none overflows."""
    ii = jax.lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0)
    jj = jax.lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1)
    below = ii >= jj if inclusive else ii > jj
    return jnp.exp(jnp.where(below, x.gam[:, None] - x.gam[None, :], -1e30))


def _products(precision, bf16: bool):
    """The intra launches' score and W / U products: f32 operands at ``precision``, or bf16
    MMAs with ``bf16`` (:func:`~pallas_kernels.common.delta_rule_gpu.operand_products`)."""
    return operand_products(precision, jnp.bfloat16 if bf16 else jnp.float32)


def _kk_scores(x: _ChunkRows, prod):
    """``A = strict_lower(beta_i k_i . k_j e^(gam_i - gam_j))``."""
    return x.beta[:, None] * prod(x.k, x.k, NT) * _decays(x, False)


def _store_w_u(x: _ChunkRows, win, h, tm, prod, v_ref, w_ref, u_ref, tma_layout):
    """``W = Tm (beta e^gam k)`` and ``U = Tm (beta v)`` (``U^T`` with ``tma_layout``), by
    ``prod`` (:func:`_products`)."""
    op, rows = w_ref.dtype, win.valid[:, None]
    w = prod(tm, x.k * (x.beta * jnp.exp(x.gam))[:, None])  # [C, Dk]
    pltr.store(w_ref.at[h, win.rows, :], w.astype(op), mask=rows)
    dv = v_ref.shape[-1]
    bv = dv & -dv  # Dv itself when a power of two (one tile), else its largest such divisor
    for vb in range(dv // bv):
        vs = pl.ds(vb * bv, bv)
        v = pltr.load(v_ref.at[win.rows, h, vs], mask=rows, other=0.0)
        u = prod(tm, v.astype(jnp.float32) * x.beta[:, None])  # [C, BV]
        if tma_layout:
            pltr.store(u_ref.at[h, vs, win.rows], u.T.astype(op), mask=win.valid[None, :])
        else:
            pltr.store(u_ref.at[h, win.rows, vs], u.astype(op), mask=rows)


def _store_q_k_rows(x: _ChunkRows, win, h, prod, live_ref, qd_ref, kd_ref, aqk_ref,
                    tma_layout):  # fmt: skip
    """``Aqk = incl_lower(q_i . k_j e^(gam_i - gam_j))``, ``q e^gam`` and
    ``k e^(gam_last - gam)`` (with ``tma_layout`` zero on the block's rows after the batch's
    last token, which no chunk writes)."""
    op, rows = qd_ref.dtype, win.valid[:, None]
    a_qk = prod(x.q, x.k, NT) * _decays(x, True)
    pltr.store(aqk_ref.at[h, win.rows, :], a_qk.astype(op), mask=rows)
    q_dec = (x.q * jnp.exp(x.gam)[:, None]).astype(op)
    pltr.store(qd_ref.at[h, win.rows, :], q_dec, mask=rows)
    k_dec = x.k * jnp.exp(x.gam_last - x.gam)[:, None]  # zero on the rows outside the chunk
    kd_rows = (win.valid | (win.tok >= live_ref[0]))[:, None] if tma_layout else rows
    pltr.store(kd_ref.at[h, win.rows, :], k_dec.astype(op), mask=kd_rows)


def _intra_kernel_scores(
    c_start_ref, c_len_ref, live_ref, alog_ref, dtb_ref, q_ref, k_ref, a_ref, b_ref,
    qd_ref, kd_ref, aqk_ref, dl_ref, tm_ref,
    *, ratio: int, scale: float, precision, tma_layout: bool = False,
):  # fmt: skip
    """The split form's first launch (``form="split"``, as FLA's chunk kernels split it): the
    scores, q's and k's rows, the decay, and ``Tm = (I + A)^-1`` stored (``[Hv, Tp, C]`` in
    the operand dtype, window columns) for :func:`_intra_kernel_wu`. No v, no W / U: fewer
    tiles live than in :func:`_intra_kernel`, which sits at the register cap."""
    prod = _products(precision, False)

    def body(ci, h, win):
        x = _chunk_rows(win, h, h // ratio, scale, alog_ref, dtb_ref, k_ref, a_ref, b_ref, q_ref)
        _store_q_k_rows(x, win, h, prod, live_ref, qd_ref, kd_ref, aqk_ref, tma_layout)
        tm = unit_lower_inverse(_kk_scores(x, prod), precision)
        pltr.store(tm_ref.at[h, win.rows, :], tm.astype(tm_ref.dtype), mask=win.valid[:, None])
        dl_ref[ci, h] = jnp.exp(x.gam_last)

    _chunk_program(c_start_ref, c_len_ref, k_ref.shape[0], tma_layout, body)


def _intra_kernel_wu(
    c_start_ref, c_len_ref, alog_ref, dtb_ref, k_ref, v_ref, a_ref, b_ref, tm_ref, w_ref, u_ref,
    *, ratio: int, precision, tma_layout: bool = False, bf16_products: bool = False,
):  # fmt: skip
    """The split forms' second launch: ``W`` and ``U`` from the stored ``Tm`` (its rows
    outside the chunk read as zeros: those of W and U are not stored), k's rows and the gates
    read again; bf16 products with ``bf16_products``."""
    prod = _products(precision, bf16_products)

    def body(ci, h, win):
        x = _chunk_rows(win, h, h // ratio, 1.0, alog_ref, dtb_ref, k_ref, a_ref, b_ref)
        tm = pltr.load(tm_ref.at[h, win.rows, :], mask=win.valid[:, None], other=0.0)
        _store_w_u(x, win, h, tm.astype(jnp.float32), prod, v_ref, w_ref, u_ref, tma_layout)

    _chunk_program(c_start_ref, c_len_ref, k_ref.shape[0], tma_layout, body)


def _intra_kernel_blocked(
    c_start_ref, c_len_ref, live_ref, alog_ref, dtb_ref, q_ref, k_ref, v_ref, a_ref, b_ref,
    w_ref, u_ref, qd_ref, kd_ref, aqk_ref, dl_ref, tm_ref=None, vec_ref=None,
    *, ratio: int, scale: float, precision, tma_layout: bool = False, bf16_products: bool = False,
    beta_rows: bool = False,
):  # fmt: skip
    """:func:`_intra_kernel`'s outputs by ``[16, 16]`` blocks of the chunk (``blocked=True``),
    as KDA's intra launch: the rows read as four 16-row sub-blocks, ``A`` and ``Aqk`` by
    blocks ``(I, J)``, ``J <= I`` (with one decay a token, a block below the diagonal is a
    plain product times ``e^(gam_i - gam_j)``, every exponent <= 0), and ``Tm`` by
    :func:`~pallas_kernels.common.delta_rule.block_unit_lower_inverse`: ~30 products of
    ``[16, 16]`` blocks where the whole chunk's inverse is 12 dependent ``[64, 64]`` ones
    (their masks multiply zeros), 60 % of the launch's multiply-adds. Same arithmetic
    otherwise: f32 operands at ``precision``, or with ``bf16_products`` the operands of the
    score and W / U products rounded to bf16 (f32 accumulation; the inverse stays f32), as
    FLA's chunk kernels: bf16 MMAs run at twice TF32's rate on Hopper. With ``tm_ref`` (the
    ``"split_blocked"`` form's first launch: no ``v``, ``W``, ``U``) ``Tm``'s blocks are stored
    there instead of W and U (:func:`_intra_kernel_wu` makes them). With ``vec_ref`` (the
    ``fold`` scratch, :func:`_intra_kernel_fold`) no ``q_dec``, ``k_dec`` or ``Aqk``: the
    rows' scalings are stored as vectors instead (:data:`FOLD_VECTORS`); with ``beta_rows``
    (the fold only, :data:`FOLD_BETA_ROWS`) ``Tm diag(beta)`` made as ``diag(beta) M^-1``."""
    fold = vec_ref is not None
    beta_rows = fold and beta_rows
    ii = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
    jj = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)

    pmm = _products(precision, bf16_products)  # a score or W / U product

    def body(ci, h, win):
        hk, w0 = h // ratio, win.rows.start
        rows, valid, q, k, beta, gam, inv_q, inv_k = [], [], [], [], [], [], [], []
        carry = jnp.zeros((), jnp.float32)
        for blk in range(NSUB):  # rows outside the chunk load zeros and get g = beta = 0
            r, ok = sub_rows(w0, blk, SUB, win.start, win.length)
            kb = pltr.load(k_ref.at[r, hk, :], mask=ok[:, None], other=0.0)
            qb = pltr.load(q_ref.at[r, hk, :], mask=ok[:, None], other=0.0)
            ab = pltr.load(a_ref.at[r, h], mask=ok, other=0.0)
            bb = pltr.load(b_ref.at[r, h], mask=ok, other=0.0)
            g, be = _gates(alog_ref, dtb_ref, h, ab, bb)
            g = jnp.where(ok, g, 0.0)
            gam.append(carry + jnp.cumsum(g))  # [16], from the window's first row
            carry = carry + jnp.sum(g)
            rows.append(r)
            valid.append(ok)
            if fold:  # l2norm's factors, kept for the serial launch's row scalings
                kf, qf = kb.astype(jnp.float32), qb.astype(jnp.float32)
                inv_k.append(jax.lax.rsqrt(jnp.sum(kf * kf, axis=1) + 1e-6))
                inv_q.append(jax.lax.rsqrt(jnp.sum(qf * qf, axis=1) + 1e-6))
                k.append(kf * inv_k[-1][:, None])
            else:
                k.append(l2norm(kb.astype(jnp.float32)))
                q.append(l2norm(qb.astype(jnp.float32)) * scale)
            beta.append(jnp.where(ok, be, 0.0))
        gam_last = carry
        # v read before any store: a load after a store waits for it (the compiler cannot
        # tell that they do not alias)
        v_blocks = None if v_ref is None or fold else load_v_blocks(v_ref, rows, valid, h)
        # In the order that ends each tile's life soonest (registers: the whole chunk's launch
        # sits at the cap): the scores, q's products and rows stored (q dead after them)
        a_kk = {}
        for bi in range(NSUB):  # (the fold: k's scores only; Aqk is the serial launch's)
            r, ok = rows[bi], valid[bi][:, None]
            for bj in range(NSUB):  # Aqk is inclusive lower: the blocks above it are zeros
                a_qk = jnp.zeros((SUB, SUB), jnp.float32)
                if bj <= bi:
                    diff = gam[bi][:, None] - gam[bj][None, :]  # <= 0 where i >= j
                    if beta_rows:  # L diag(beta): beta_j in the exponent (still <= 0; outside
                        # the chunk beta is 0 and k's rows zeros: e^-69 times 0)
                        lb = jnp.log(beta[bj] + 1e-30)
                        diff = gam[bi][:, None] - (gam[bj] - lb)[None, :]
                    if bi == bj:
                        e_kk = jnp.exp(jnp.where(ii > jj, diff, -1e30))
                        e_qk = jnp.exp(jnp.where(ii >= jj, diff, -1e30))
                    else:
                        e_kk = e_qk = jnp.exp(diff)
                    if beta_rows:
                        a_kk[bi, bj] = pmm(k[bi], k[bj], NT) * e_kk
                    else:
                        a_kk[bi, bj] = beta[bi][:, None] * pmm(k[bi], k[bj], NT) * e_kk
                    if not fold:
                        a_qk = pmm(q[bi], k[bj], NT) * e_qk
                if not fold:
                    cols = pl.ds(bj * SUB, SUB)
                    pltr.store(aqk_ref.at[h, r, cols], a_qk.astype(aqk_ref.dtype), mask=ok)
            if not fold:
                q_dec = q[bi] * jnp.exp(gam[bi])[:, None]
                pltr.store(qd_ref.at[h, r, :], q_dec.astype(qd_ref.dtype), mask=ok)
        t = block_unit_lower_inverse(a_kk, NSUB, precision)  # (beta_rows: (I + L diag(beta))^-1,
        # its rows scaled by beta where stored and in W: Tm diag(beta) = diag(beta) M^-1)
        # k's rows stored and turned into W's operand (k dead after them), then W (not in the
        # split form's first launch: Tm's blocks are stored instead)
        kb_dec = []
        for bi in range(NSUB):
            r, ok = rows[bi], valid[bi][:, None]
            kd_ok = ok
            if tma_layout:  # k_dec zero on the block's rows after the batch's last token
                tok = w0 + bi * SUB + jnp.arange(SUB, dtype=jnp.int32)
                kd_ok = ok | (tok >= live_ref[0])[:, None]
            if fold:  # the rows' scalings (FOLD_VECTORS), zeros after the batch's last token
                a_q = inv_q[bi] * scale
                vecs = (a_q * jnp.exp(gam[bi]), inv_k[bi] * jnp.exp(gam_last - gam[bi]), a_q,
                        inv_k[bi], gam[bi])  # fmt: skip
                for i, x in enumerate(vecs):
                    row = vec_ref.at[h, jnp.int32(i), r]
                    pltr.store(row, jnp.where(ok[:, 0], x, 0.0), mask=kd_ok[:, 0])
            else:
                k_dec = k[bi] * jnp.exp(gam_last - gam[bi])[:, None]  # zero outside the chunk
                pltr.store(kd_ref.at[h, r, :], k_dec.astype(kd_ref.dtype), mask=kd_ok)
            if beta_rows:  # (beta is in t's rows)
                kb_dec.append(k[bi] * jnp.exp(gam[bi])[:, None])
            elif tm_ref is None or fold:
                kb_dec.append(k[bi] * (beta[bi] * jnp.exp(gam[bi]))[:, None])
        dl_ref[ci, h] = jnp.exp(gam_last)
        if tm_ref is not None:  # Tm by blocks, zeros above the diagonal ones (the fold: U's
            for bi in range(NSUB):  # factor Tm diag(beta), then W here and U in the serial launch)
                for bj in range(NSUB):
                    blk = t[bi, bj] if bj <= bi else jnp.zeros((SUB, SUB), jnp.float32)
                    if beta_rows and bj <= bi:
                        blk = beta[bi][:, None] * blk
                    elif fold and bj <= bi:
                        blk = blk * beta[bj][None, :]
                    pltr.store(tm_ref.at[h, rows[bi], pl.ds(bj * SUB, SUB)],
                               blk.astype(tm_ref.dtype), mask=valid[bi][:, None])  # fmt: skip
            if not fold:
                return
        store_blocked_w_u(
            t, kb_dec, rows, valid, beta, h, v_ref, w_ref, None if fold else u_ref, pmm,
            tma_layout, v_blocks, w_row_scale=beta if beta_rows else None,
        )  # fmt: skip

    _chunk_program(c_start_ref, c_len_ref, k_ref.shape[0], tma_layout, body)


# The fold scratch's per-token vectors (``[Hv, 8, Tp]`` f32, rows in this order; the serial
# launch's row scalings, chunk_scan_mgpu): q's output scale (l2norm's factor times
# ``Dk^-1/2 e^gam``), k_dec's (l2norm's factor times ``e^(gam_last - gam)``), q's and k's
# l2norm factors (q's times ``Dk^-1/2``) and ``gam``, from the chunk's window start.
FOLD_VECTORS = ("q_out", "k_state", "q_norm", "k_norm", "gam")
FOLD_ROWS = chunk_scan_mgpu.FOLD_ROWS  # FOLD_VECTORS padded (a TMA box's rows)


def _intra_kernel_fold(
    c_start_ref, c_len_ref, live_ref, alog_ref, dtb_ref, q_ref, k_ref, a_ref, b_ref,
    w_ref, tm_ref, vec_ref, dl_ref, **params,
):  # fmt: skip
    """The ``fold`` scratch (:class:`~pallas_kernels.common.chunk_scan_mgpu.FoldRefs`): W and
    the decay as :func:`_intra_kernel_blocked` makes them, U's factor ``Tm diag(beta)`` by
    blocks (``[Hv, Tp, 64]``: a token's row, the window's columns), and instead of ``q_dec``,
    ``k_dec`` and ``Aqk`` the vectors of :data:`FOLD_VECTORS`: the Mosaic GPU serial launch
    makes U from v's rows, ``Aqk`` and the rows' scalings from q's and k's. No v read here."""
    _intra_kernel_blocked(
        c_start_ref, c_len_ref, live_ref, alog_ref, dtb_ref, q_ref, k_ref, None, a_ref, b_ref,
        w_ref, None, None, None, None, dl_ref, tm_ref=tm_ref, vec_ref=vec_ref, **params,
    )  # fmt: skip


def _intra_kernel_blocked_scores(
    c_start_ref, c_len_ref, live_ref, alog_ref, dtb_ref, q_ref, k_ref, a_ref, b_ref,
    qd_ref, kd_ref, aqk_ref, dl_ref, tm_ref, **params,
):  # fmt: skip
    """The ``"split_blocked"`` form's first launch: :func:`_intra_kernel_scores`'s outputs
    made by :func:`_intra_kernel_blocked` (the cheaper inverse by blocks)."""
    _intra_kernel_blocked(
        c_start_ref, c_len_ref, live_ref, alog_ref, dtb_ref, q_ref, k_ref, None, a_ref, b_ref,
        None, None, qd_ref, kd_ref, aqk_ref, dl_ref, tm_ref, **params,
    )  # fmt: skip


def intra_launch(
    q, k, v, a, b, A_log, dt_bias, plan, *, num_chunks: int, operand_dtype, precision,
    num_warps: int = 8, num_stages: int = 2, tma_layout: bool = False, form: str = "whole",
    fold: bool = False, fold_beta_rows: bool | None = None, fold_intra: str | None = None,
    fold_aqk: bool = False, fold_persist: int | None = None, interpret: bool = False,
) -> ChunkRefs | chunk_scan_mgpu.FoldRefs:  # fmt: skip
    """Launch 1 (:func:`_intra_kernel`, or by 16-row blocks :func:`_intra_kernel_blocked`:
    ``form``, one of :data:`INTRA_FORMS`) over grid ``(NC, Hv)`` on inputs padded to at least
    one chunk (:func:`~pallas_kernels.common.delta_rule_gpu.pad_tokens`). ``tma_layout``: the
    Mosaic GPU serial launch's scratch, on a token-aligned plan; ``u`` is then
    ``U^T [Hv, Dv, Tp]`` (``Tp`` a multiple of 64: TMA's tiles). ``fold`` (with
    ``tma_layout``, a ``"blocked"`` form): :func:`_intra_kernel_fold`'s scratch,
    :class:`~pallas_kernels.common.chunk_scan_mgpu.FoldRefs`; ``fold_beta_rows`` (None:
    :data:`FOLD_BETA_ROWS`) its ``Tm diag(beta)`` as ``diag(beta) M^-1``; ``fold_intra``
    (``"mgpu"``, ``"triton"`` or None: :data:`FOLD_INTRA`, Triton's in interpret mode;
    ``chunk_scan_mgpu.choose_mgpu``) ``"mgpu"`` makes it by :func:`.intra_mgpu.fold_scratch`
    instead (``diag(beta) M^-1`` too), with ``fold_aqk`` each chunk's ``Aqk`` as well."""
    if fold and not (tma_layout and form.startswith("blocked")):
        raise ValueError(f"fold: the Mosaic GPU launch's scratch, a blocked form; not {form!r}")
    tp, hk, dk = q.shape
    _, hv, dv = v.shape
    op = operand_dtype
    shapes = chunk_refs_shapes(hv, tp, dk, dv, CHUNK, num_chunks, op, False, tma_layout)
    live = live_end(plan) if tma_layout else jnp.zeros(1, jnp.int32)
    common = dict(ratio=hv // hk, scale=float(dk) ** -0.5, precision=precision,
                  tma_layout=tma_layout)  # fmt: skip
    if form not in INTRA_FORMS:
        raise ValueError(f"intra launch form {form!r}: one of {INTRA_FORMS}")
    if form.startswith("split"):
        return _split_intra(
            q, k, v, a, b, A_log, dt_bias, plan, live, shapes, common, num_chunks, num_warps,
            num_stages, interpret, blocked=form != "split", bf16=form.endswith("bf16"),
        )  # fmt: skip
    if fold and chunk_scan_mgpu.choose_mgpu(
        "fold_intra", fold_intra, FOLD_INTRA, "HYJAX_GDN_FOLD_INTRA", interpret,
        lambda: intra_mgpu.unsupported_reason(dk, op), "GDN fold launch",
    ):  # fmt: skip
        return intra_mgpu.fold_scratch(
            q, k, v, a, b, A_log, dt_bias, plan, num_chunks=num_chunks, operand_dtype=op,
            with_aqk=fold_aqk, persist=fold_persist, interpret=interpret,
        )  # fmt: skip
    if fold:
        vec = jax.ShapeDtypeStruct((hv, FOLD_ROWS, tp), jnp.float32)
        kernel = functools.partial(
            _intra_kernel_fold,
            bf16_products=form == "blocked_bf16",
            beta_rows=FOLD_BETA_ROWS if fold_beta_rows is None else fold_beta_rows,
            **common,
        )
        w, tm, vec, decay = pl.pallas_call(
            kernel,
            grid=(num_chunks, hv),
            out_shape=[shapes.w, shapes.a_qk, vec, shapes.decay],
            compiler_params=compiler_params(num_warps, num_stages),
            interpret=interpret,
            name="gdn_prefill_intra_gpu",
        )(plan.start, plan.length, live, A_log, dt_bias, q, k, a, b)
        return chunk_scan_mgpu.FoldRefs(w, tm, v, q, k, vec, decay)
    if form in ("whole", "whole_bf16"):
        kernel = functools.partial(_intra_kernel, bf16_products=form == "whole_bf16", **common)
    else:
        kernel = functools.partial(
            _intra_kernel_blocked, bf16_products=form == "blocked_bf16", **common
        )
    return ChunkRefs(
        *pl.pallas_call(
            kernel,
            grid=(num_chunks, hv),
            out_shape=list(shapes),
            compiler_params=compiler_params(num_warps, num_stages),
            interpret=interpret,
            name="gdn_prefill_intra_gpu",
        )(plan.start, plan.length, live, A_log, dt_bias, q, k, v, a, b)
    )


def _split_intra(q, k, v, a, b, A_log, dt_bias, plan, live, shapes: ChunkRefs, common,
                 num_chunks, num_warps, num_stages, interpret, blocked,
                 bf16=False) -> ChunkRefs:  # fmt: skip
    """:func:`intra_launch`'s split forms: two launches over grid ``(NC, Hv)``, the first by
    16-row blocks with ``blocked``, the products bf16 with ``bf16`` (blocked only)."""
    hv, tp, _ = shapes.q_dec.shape
    tm_type = jax.ShapeDtypeStruct((hv, tp, CHUNK), shapes.q_dec.dtype)
    params = dict(grid=(num_chunks, hv), compiler_params=compiler_params(num_warps, num_stages),
                  interpret=interpret)  # fmt: skip
    first = _intra_kernel_blocked_scores if blocked else _intra_kernel_scores
    more = dict(bf16_products=True) if bf16 else {}
    q_dec, k_dec, a_qk, decay, tm = pl.pallas_call(
        functools.partial(first, **common, **more),
        out_shape=[shapes.q_dec, shapes.k_dec, shapes.a_qk, shapes.decay, tm_type],
        name="gdn_prefill_intra_scores_gpu", **params,
    )(plan.start, plan.length, live, A_log, dt_bias, q, k, a, b)  # fmt: skip
    wu = {key: common[key] for key in ("ratio", "precision", "tma_layout")}
    w, u = pl.pallas_call(
        functools.partial(_intra_kernel_wu, **wu, **more),
        out_shape=[shapes.w, shapes.u],
        name="gdn_prefill_intra_wu_gpu", **params,
    )(plan.start, plan.length, A_log, dt_bias, k, v, a, b, tm)  # fmt: skip
    return ChunkRefs(w, u, q_dec, k_dec, a_qk, decay)


def prefill_scratch(
    q, k, v, a, b, A_log, dt_bias, query_start_loc, slots: StateSlots, *, operand_dtype,
    precision, num_warps: int | None = None, num_stages: int | None = None,
    tma_layout: bool = False, form: str | None = None, fold: bool = False,
    fold_beta_rows: bool | None = None, fold_intra: str | None = None, fold_aqk: bool = False,
    fold_persist: int | None = None, interpret: bool = False,
):  # fmt: skip
    """The prefill up to its serial launch: the chunk plan, the plan by row and the intra
    launch's scratch (:func:`intra_launch`, on inputs padded to a 64-row window; in the Mosaic
    GPU launch's layout with ``tma_layout``): ``(plan, row plan, ChunkRefs)``. ``form`` None:
    :func:`default_intra_form`; ``num_warps`` / ``num_stages`` None: the form's
    :data:`INTRA_TUNING`."""
    form = default_intra_form(operand_dtype) if form is None else form
    tuned_warps, tuned_stages = INTRA_TUNING.get(form, (8, 2))  # intra_launch names a bad one
    num_warps = tuned_warps if num_warps is None else num_warps
    num_stages = tuned_stages if num_stages is None else num_stages
    n = q.shape[0]
    rows, max_ckpt = slots.ckpt_offsets.shape
    plan = plan_chunks(query_start_loc, slots, num_tokens=n, chunk=CHUNK, token_aligned=tma_layout)
    nc = max_chunks(n, rows, max_ckpt, CHUNK)
    # the 64-row window needs T >= 64; the Mosaic GPU launch (tma_layout) a multiple of 64:
    # its windows are the batch's 64-token blocks (chunk_scan_mgpu)
    (q, k, v, a, b), _ = pad_tokens((q, k, v, a, b), CHUNK, CHUNK if tma_layout else 1)
    x = intra_launch(
        q, k, v, a, b, A_log, dt_bias, plan, num_chunks=nc, operand_dtype=operand_dtype,
        precision=precision, num_warps=num_warps, num_stages=num_stages,
        tma_layout=tma_layout, form=form, fold=fold, fold_beta_rows=fold_beta_rows,
        fold_intra=fold_intra, fold_aqk=fold_aqk, fold_persist=fold_persist, interpret=interpret,
    )  # fmt: skip
    return plan, row_plan(plan, slots, nc), x


def gdn_prefill(
    q: jax.Array,  # [T, Hk, Dk]  post-conv, before l2norm
    k: jax.Array,  # [T, Hk, Dk]
    v: jax.Array,  # [T, Hv, Dv]
    a: jax.Array,  # [T, Hv]
    b: jax.Array,  # [T, Hv]
    A_log: jax.Array,  # f32[Hv]
    dt_bias: jax.Array,  # f32[Hv]
    state: jax.Array,  # f32 | bf16[num_slots, Hv, Dv, Dk]  donated: updated in place
    query_start_loc: jax.Array,  # i32[S+1]
    slots: StateSlots,  # DESIGN.md §3
    *,
    block_v: int | None = None,
    precision=jax.lax.Precision.HIGHEST,
    operand_dtype=None,
    num_warps: int = 4,
    num_stages: int = 2,
    intra_num_warps: int | None = None,
    intra_num_stages: int | None = None,
    vb_first: bool = SERIAL_VB_FIRST,
    three_launches: bool = False,
    intra_form: str | None = None,
    block_v_out: int | None = None,
    serial: str | None = None,
    fold: bool | None = None,
    fold_beta_rows: bool | None = None,
    fold_intra: str | None = None,
    fold_aqk: bool | None = None,
    fold_persist: int | None = None,
    serial_pair: bool | str | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Chunked ragged prefill; see the module docstring. Returns ``(o [T, Hv, Dv], state)``.

        ``serial`` picks the serial launch: ``"triton"``, ``"mgpu"`` (Mosaic GPU:
        :mod:`pallas_kernels.common.chunk_scan_mgpu`, on a token-aligned chunk plan; 16-bit
        operands, an f32 pool, ``Dk`` 64 or 128, ``Dv`` a multiple of 64, two launches), or None:
        ``chunk_scan_mgpu.SERIAL_DEFAULT`` (Mosaic GPU where it can take the shapes, else Triton
        with one log line; in interpret mode Triton always).
        ``interpret`` runs either in its interpreter.

        ``precision`` is the matmul precision inside the chunk (``HIGHEST``: IEEE f32; a
        ``DotAlgorithmPreset`` such as ``BF16_BF16_F32_X3`` or ``DEFAULT`` (TF32) trade accuracy
        for tensor-core speed). ``operand_dtype`` is the dtype of the products' operands after the
        UT transform and of the scratch between launches (:func:`operand_dtype_for`: bf16 for bf16
        activations, float32 for float32 ones); accumulation and the running state stay float32.

    ``three_launches`` moves the output out of the serial launch into a parallel one, at the
        cost of a scratch of every chunk's starting state (``[NC, Hv, Dk, Dv]`` in the operand
        dtype). ``block_v`` (default: :func:`~pallas_kernels.common.delta_rule_gpu.serial_block_v`
        by the launch's size), ``num_warps`` and ``num_stages`` tune the serial launch,
        ``intra_num_warps`` / ``intra_num_stages`` the intra launch (None: its form's
        :data:`INTRA_TUNING`), ``vb_first`` the serial grid's order
        (:func:`~pallas_kernels.common.delta_rule_gpu.serial_grid`), ``intra_form`` the intra
        launch's form (:data:`INTRA_FORMS`; None: :func:`default_intra_form`). ``fold`` (None:
        :data:`FOLD`, on; only where the serial launch is Mosaic GPU's and the intra form a
        blocked one): U, ``Aqk`` and the rows' scalings made in the serial launch from v's, q's
        and k's rows (the module docstring; :func:`_intra_kernel_fold`,
        ``chunk_scan_mgpu.FoldRefs``); ``fold_beta_rows`` (None: :data:`FOLD_BETA_ROWS`, on) the
        intra launch's ``Tm diag(beta)`` as ``diag(beta) M^-1`` (no column scaling);
        ``fold_intra`` (None: :data:`FOLD_INTRA`) who makes the fold's scratch: ``"triton"``
        (that intra launch) or ``"mgpu"`` (:mod:`.intra_mgpu`: XLA and a Mosaic GPU launch);
        ``fold_aqk`` (None: :data:`FOLD_AQK`, off; the Mosaic GPU scratch only) each chunk's
        ``Aqk`` made with that scratch instead of in the serial launch; ``fold_persist``
        (None: ``intra_mgpu.persist_programs``, four an SM; 0: the plain launch) that scratch's
        launch as a persistent one of so many programs. ``serial_pair`` (None:
        ``chunk_scan_mgpu.PAIR``, off; the fold without ``fold_aqk``, ``Dv`` 128) the serial
        launch's two Dv blocks of a (head, row) in one program, a warpgroup each
        (``chunk_scan_mgpu.use_pair``; ``"dynamic"``: both launches, the plan picking one on
        the device by its long rows, ``chunk_scan_mgpu.pair_mode``).
    """
    check_gdn_args(q, k, v, a, b, A_log, dt_bias, state, slots, query_start_loc)
    n, _, dk = q.shape
    _, hv, dv = v.shape
    check_key_dim(dk)
    op = operand_dtype_for(v.dtype, operand_dtype)
    rows, max_ckpt = slots.ckpt_offsets.shape
    nc = max_chunks(n, rows, max_ckpt, CHUNK)
    mgpu = chunk_scan_mgpu.serial_is_mgpu(
        serial, dk, dv, nc, op, state.dtype, three_launches, interpret, False
    )
    form = default_intra_form(op) if intra_form is None else intra_form
    fold = mgpu and form.startswith("blocked") and (FOLD if fold is None else fold)
    fold = fold and chunk_scan_mgpu.smem_bytes(dk, nc, state.dtype, op, fold=True) <= (
        chunk_scan_mgpu.SMEM_BYTES
    )  # (its stage is 2 KB larger: past it, the unfolded launch)
    fold_aqk = fold and (FOLD_AQK if fold_aqk is None else fold_aqk)
    fold_aqk = (
        fold_aqk
        and chunk_scan_mgpu.smem_bytes(dk, nc, state.dtype, op, fold=True, fold_aqk=True)
        <= chunk_scan_mgpu.SMEM_BYTES
    )  # (an 8 KB tile a stage more: past it, Aqk made there)
    plan, rp, x = prefill_scratch(
        q, k, v, a, b, A_log, dt_bias, query_start_loc, slots, operand_dtype=op,
        precision=precision, num_warps=intra_num_warps, num_stages=intra_num_stages,
        tma_layout=mgpu, form=form, fold=fold, fold_beta_rows=fold_beta_rows,
        fold_intra=fold_intra, fold_aqk=fold_aqk, fold_persist=fold_persist,
        interpret=interpret,
    )  # fmt: skip
    if mgpu:
        return chunk_scan_mgpu.scan_mgpu(
            rp, x, state, out_dtype=v.dtype, live=plan.live, pair=serial_pair,
            interpret=interpret,
        )  # fmt: skip
    bv = serial_block_v(slots.num_rows, hv, dv, block_v)
    o, state = scan_launches(
        rp, x, state, plan.start, plan.length, out_dtype=v.dtype, bv=bv, precision=precision,
        num_warps=num_warps, num_stages=num_stages, vb_first=vb_first,
        three_launches=three_launches, block_v_out=block_v_out, interpret=interpret,
        name="gdn_prefill",
    )  # fmt: skip
    return jnp.where(plan.live[:, None, None], o[:n], 0).astype(v.dtype), state
