"""KDA Pallas kernels for NVIDIA GPUs (Triton lowering), with explicit state slots.

Same signatures and semantics as :mod:`pallas_kernels.kda.reference` (DESIGN.md §3), the
same slot contract and layout as the GDN kernels: tiles, slot loads and stores, the decode
program, the prefill windows and the row scan are :mod:`pallas_kernels.common.delta_rule_gpu`'s,
the chunk step :mod:`pallas_kernels.common.delta_rule`'s. The gate is computed in the kernel:
``g = -exp(A_log[h]) * softplus(g_raw + dt_bias[h])``, one per key channel. ``interpret=True``
runs them with Pallas' generic interpreter on CPU (how CI tests them).

The pool holds each state transposed, ``[num_slots, H, Dv, Dk]`` (DESIGN.md §3).

Decode
------
grid = (S * Dv / BV, H); a program owns ``state[slot, h, v0:v0+BV, :]`` of one row (a
contiguous ``[BV, Dk]`` tile of ``S^T``, by default 16 rows on one warp) and decays it per key
channel: ``S = diag(exp(g)) S``, i.e. ``S^T``'s columns.

Prefill (chunked WY/UT form, two launches)
------------------------------------------
The per-channel decay sits inside the intra-chunk dot products, so they are not plain
matmuls. Chunks of at most 64 tokens, read as 64-row windows (``T >= 64``: the wrapper pads)
of four 16-row sub-blocks; ``gam = cumsum(g)`` from the window's first row (rows outside the
chunk have ``g = beta = 0`` and zero q/k/v, so ``gam`` restarts at the chunk)::

    Akk[i, j] = beta_i sum_d k_id k_jd e^(gam_id - gam_jd)   (i > j)    Aqk: q_i, i >= j

1. ``_intra_kernel``, grid = (NC, H), every chunk in parallel. Akk and Aqk by ``[16, 16]``
   blocks (I, J), every ``exp`` argument <= 0:

   - diagonal blocks (I = J): one column ``j`` at a time, ``e^(gam_i - gam_j)`` for rows
     ``i >= j`` as a ``[16, Dk]`` tile (elementwise f32), by default in a launch of its own
     before this one (``_diag_kernel``, ``DIAG_FORM="launch_rows"``; ``"columns"``: here);
   - blocks below it (J < I): factored through ``gam_r``, the first row of block I:
     ``(q_i e^(gam_i - gam_r)) . (k_j e^(gam_r - gam_j))``, a ``[16, Dk] x [Dk, 16]`` dot.
     ``gam`` never increases (``g <= 0``) and J's rows precede ``r``, so both exponents are
     <= 0: a product that underflows is one whose true value does.

   Then ``Tm = (I + Akk)^-1`` by blocks (``T_II = unit_lower_inverse(A_II)``,
   ``T_IJ = -T_II sum_{J<=K<I} A_IK T_KJ``), ``W = Tm (beta k e^gam)``, ``U = Tm (beta v)``.
   Stored head-major (``[H, T, D]``, valid rows only, so the scratch scales with the tokens):
   W, U, ``q e^gam``, ``k e^(gam_last - gam)``, Aqk (``[H, T, 64]``, columns = window rows,
   zeros above the diagonal blocks), and ``e^gam_last`` per chunk and key channel: GDN's
   :class:`~pallas_kernels.common.chunk_scan_gpu.ChunkRefs` with a ``[Dk]`` decay.
2. The serial launch, GDN's (:mod:`pallas_kernels.common.chunk_scan_gpu`): one program per
   (row, head, Dv block) walks its row's chunks in order with ``S [Dk, BV]`` in registers:
   ``V' = U - W S``, ``o = (q e^gam) S + Aqk V'``,
   ``S = diag(e^gam_last) S + (k e^(gam_last - gam))^T V'``, storing checkpoints and ``dst``.
   No per-chunk scratch of states: no length or batch needs another path.
   ``three_launches=True`` splits it into a state launch and a parallel output launch, as for
   GDN.

``operand_dtype`` (:func:`operand_dtype_for`; bf16 for bf16 activations) is that of the dot
operands after the gates (the off-diagonal scores, W, U, V', the decayed rows, Aqk) and of the
scratch, with f32 accumulation, as FLA's ``chunk_kda`` runs; the carried state and the inverse
stay f32. :func:`unsupported_reason` says which head dims ``hyjax.ops`` must leave to the
reference.
"""

from __future__ import annotations

import functools
import os

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
    softplus_poly,
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
    operand_precision,
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
from pallas_kernels.kda.reference import check_kda_args

CHUNK = 64  # the prefill's chunks: four 16-row sub-blocks
SUB = 16
LOG2E = 1.4426950408889634  # exp(x) = exp2(x log2(e))
# The diagonal blocks' scores (intra_launch's diag_form): "launch_rows", the default, a column
# at a time (elementwise f32, _diag_block) in a launch of their own (_diag_kernel, a program
# per chunk, 16-row block and head), each column's row read from memory, their blocks read by
# the intra launch; "launch", the same with each column's row taken out of the tiles; or
# "columns", the loop in the intra launch. The intra launch alone at 8x4096 on an H200
# (BENCHMARKS.md, session 33, one process): launch_rows 6.65 ms (diagonal launch at 4 warps;
# 6.80 at 2, 10.27 at 8), launch 6.79 (2 warps; 7.53 at 4, 9.84 at 8), columns 9.66 (intra
# launch at 2 warps, its fastest). HYJAX_KDA_DIAG=<form> for a process.
# Measured slower and removed: the diagonal blocks by four f32 dots a block through each
# pair's middle row with the rows' gam gathered by a product ("levels": 15.8 ms against 12.1,
# session 31), and every score block in a launch of its own, a program a
# 16-row block (8.85 ms against 7.68, session 32).
# "mid" (opt-in, not yet timed): "launch_rows"' launch with each block made by two products
# through its middle row (_mid_block) where the block's decay allows it, else the column loop.
DIAG_FORMS = ("columns", "launch", "launch_rows", "mid")
# "mid": a block's largest decay over its 16 rows (natural log, any key channel) up to which
# its products go through the middle row: every factor then stays within e^+-MID_SPAN, far
# inside f32's and bf16's range (e^88); past it, the column loop.
MID_SPAN = 40.0
DIAG_FORM = os.environ.get("HYJAX_KDA_DIAG") or "launch_rows"
# The diagonal launch's warps by form (HYJAX_KDA_DIAG_WARPS for a process), the fastest above.
DIAG_WARPS = {"launch": 2, "launch_rows": 4, "mid": 4}
DIAG_NUM_WARPS = int(os.environ.get("HYJAX_KDA_DIAG_WARPS") or 0) or None
# The intra launch's warps when not told (kda_prefill's intra_num_warps None;
# HYJAX_KDA_INTRA_WARPS for a process), by diagonal form: the fastest at 8x4096 on an H200
# (columns: 2 warps 10.4 ms, 4 12.1, 8 12.2; launch: 2 8.69, 4 8.95, 8 7.52, session 32)
INTRA_WARPS = {"columns": 2, "launch": 8, "launch_rows": 8, "mid": 8}
INTRA_NUM_WARPS = int(os.environ.get("HYJAX_KDA_INTRA_WARPS") or 0) or None
NSUB = CHUNK // SUB


def _check(q, k, v, g, b, A_log, dt_bias, state, slots, qsl=None):
    check_kda_args(q, k, v, g, b, A_log, dt_bias, state, slots, qsl)
    check_key_dim(q.shape[-1])


def decode_gate(alog_ref, dt_ref, g_raw, h):
    """``-exp(A_log[h]) * softplus(g_raw + dt_bias[h])`` [Dk] for one token of head ``h``, the
    parameters as the layer holds them (no separate kernel a step to negate and exponentiate
    ``A_log``)."""
    neg_a = -jnp.exp(alog_ref[h].astype(jnp.float32))
    return neg_a * softplus(g_raw.astype(jnp.float32) + dt_ref[h, :].astype(jnp.float32))


def token_inputs(alog_ref, dt_ref, q_ref, k_ref, g_ref, v_ref, b_ref, tok, h, vs, *, scale):
    """One token's decode inputs for head ``h`` and Dv columns ``vs`` (the decode and
    multi-token decode kernels): ``(q, k [Dk], v [BV], beta, decay [1, Dk])``."""
    q = l2norm(q_ref[tok, h, :].astype(jnp.float32)) * scale  # [Dk]
    k = l2norm(k_ref[tok, h, :].astype(jnp.float32))
    v = v_ref[tok, h, vs].astype(jnp.float32)  # [BV]
    g = decode_gate(alog_ref, dt_ref, g_ref[tok, h, :], h)  # [Dk]
    beta = jax.nn.sigmoid(b_ref[tok, h].astype(jnp.float32))
    return q, k, v, beta, jnp.exp(g)[None, :]  # S^T's columns (S's rows), per key channel


# ----------------------------------------------------------------------------- decode


def _decode_kernel(
    p: DecodeSlots,
    alog_ref,  # f32[H]: A_log
    dt_ref,  # f32[H, Dk]
    q_ref, k_ref, g_ref,  # [S, H, Dk]
    v_ref,  # [S, H, Dv]
    b_ref,  # [S, H]
    pool_in,  # f32 | bf16[num_slots, H, Dv, Dk]
    o_ref,  # [S, H, Dv]
    pool_out,  # aliased to pool_in
    *, bv: int, scale: float,
):  # fmt: skip
    refs = (alog_ref, dt_ref, q_ref, k_ref, g_ref, v_ref, b_ref)
    inputs = functools.partial(token_inputs, *refs, scale=scale)
    decode_program(p, pool_in, o_ref, pool_out, bv=bv, inputs=inputs)


def kda_decode(
    q: jax.Array,  # [S, H, Dk]
    k: jax.Array,  # [S, H, Dk]
    v: jax.Array,  # [S, H, Dv]
    g: jax.Array,  # [S, H, Dk]  raw gate projection
    b: jax.Array,  # [S, H]
    A_log: jax.Array,  # f32[H]
    dt_bias: jax.Array,  # f32[H, Dk]
    state: jax.Array,  # f32 | bf16[num_slots, H, Dv, Dk]  donated: updated in place
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
    (``decode_mgpu.DECODE_DEFAULT``). Returns ``(o [S, H, Dv], state)``."""
    _check(q, k, v, g, b, A_log, dt_bias, state, slots)
    rows, h, dk = q.shape
    dv = v.shape[2]
    if rows != slots.num_rows:
        raise ValueError(f"decode rows {rows} must equal {slots.num_rows=} (one token each)")
    if decode_mgpu.decode_is_mgpu(kernel, state, slots, 3, interpret):
        return decode_mgpu.kda_decode_mgpu(
            q, k, v, g, b, A_log, dt_bias, state, slots, interpret=interpret
        )
    return launch_decode(
        _decode_kernel,
        name="kda_decode_gpu",
        slots=slots,
        inputs=(A_log, dt_bias, q, k, g, v, b),
        state=state,
        out_dtype=v.dtype,
        bv=pick_block_v(dv, block_v, default=DECODE_BLOCK_V),
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        scale=float(dk) ** -0.5,
    )


# ----------------------------------------------------------------------------- prefill


def _row(x, i: int):
    """Row ``i`` of a ``[16, D]`` tile as ``[D]`` (a masked sum: Triton has no value slicing)."""
    sel = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0) == i
    return jnp.sum(jnp.where(sel, x, 0.0), axis=0)


def _diag_block(q, k, gam, row=None, col_scale=None):
    """The diagonal ``[16, 16]`` blocks of ``sum_d k_id k_jd e_ij`` and ``sum_d q_id k_jd
    e_ij`` (``i >= j``, 0 above), one column ``j`` at a time so that every ``exp`` argument
    ``gam_i - gam_j`` is <= 0. Column ``j``'s row of k and ``gam`` is taken out of the tiles
    by a masked sum over them (``row`` None), which makes the loop bound by its instructions
    (ncu, session 32: ~34 an element of the ``[16, Dk]`` tile, for ~8 of arithmetic); or, the
    ``"launch_rows"`` form, read from memory: ``row(j)`` gives row ``j``'s l2-normed k and
    its gate (zeros outside the chunk; ``gam_j`` a running sum from the block's first row, as
    the tile's ``gam``), the exponent clamped at 0 on every element (the rows above ``j`` get
    1) and those rows zeroed once after the loop, in base 2 with ``gam`` scaled once (offline
    ``ptxas`` at 4 warps: 292 instructions a column against 490). ``col_scale [16]``: column
    ``j`` of both blocks multiplied by ``col_scale[j]`` after the loop (``row`` giving k's rows
    unnormalised, their inverse norms: no reduction over a row in the loop)."""
    ri = jax.lax.broadcasted_iota(jnp.int32, (SUB, 1), 0)
    ii = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
    cj = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)

    def column(j, acc):  # row j taken out of the tiles (the measured default)
        a_kk, a_qk = acc
        sel = jax.lax.broadcasted_iota(jnp.int32, gam.shape, 0) == j
        gam_j = jnp.sum(jnp.where(sel, gam, 0.0), axis=0)  # [Dk]
        k_j = jnp.sum(jnp.where(sel, k, 0.0), axis=0)
        e = jnp.exp(jnp.where(ri >= j, gam - gam_j[None, :], -1e30))  # [16, Dk], rows >= j
        return scores(j, e * k_j[None, :], a_kk, a_qk)

    def column_read(j, acc):  # row j read from memory
        a_kk, a_qk, gam_j = acc
        k_j, g_j = row(j)
        gam_j = gam_j + g_j
        e = jnp.exp2(jnp.minimum(gam2 - (gam_j * LOG2E)[None, :], 0.0))
        return (*scores(j, e * k_j[None, :], a_kk, a_qk), gam_j)

    def scores(j, kj_e, a_kk, a_qk):  # column j of both blocks
        a_kk = jnp.where(cj == j, jnp.sum(k * kj_e, axis=1)[:, None], a_kk)
        a_qk = jnp.where(cj == j, jnp.sum(q * kj_e, axis=1)[:, None], a_qk)
        return a_kk, a_qk

    zero = jnp.zeros((SUB, SUB), jnp.float32)
    if row is None:  # the rows above j: e = 0 already
        return jax.lax.fori_loop(0, SUB, column, (zero, zero))
    gam2 = gam * LOG2E  # column_read's exponents in base 2
    acc = (zero, zero, jnp.zeros(gam.shape[-1:], jnp.float32))
    a_kk, a_qk, _ = jax.lax.fori_loop(0, SUB, column_read, acc)
    if col_scale is not None:
        a_kk, a_qk = a_kk * col_scale[None, :], a_qk * col_scale[None, :]
    return jnp.where(ii > cj, a_kk, 0.0), jnp.where(ii >= cj, a_qk, 0.0)


def _mid_block(q, k, gam, prod):
    """:func:`_diag_block`'s blocks by two products through the block's middle row ``m``:
    ``sum_d k_id k_jd e^(gam_id - gam_jd) = (k_i e^(gam_i - gam_m)) . (k_j e^(gam_m -
    gam_j))``, and the same with q's rows. Where ``i >= j`` each term is the true one, the
    factors' exponents bounded by the block's decay (the caller's :data:`MID_SPAN`); above
    the diagonal the product may overflow, and is selected away. ``prod``: the intra launch's
    products (``operand_products``)."""
    ii = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
    cj = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
    gam_m = _row(gam, SUB // 2)[None, :]
    to_mid, from_mid = jnp.exp(gam - gam_m), jnp.exp(gam_m - gam)  # [16, Dk]
    k_j = k * from_mid
    a_kk = prod(k * to_mid, k_j, NT)
    a_qk = prod(q * to_mid, k_j, NT)
    return jnp.where(ii > cj, a_kk, 0.0), jnp.where(ii >= cj, a_qk, 0.0)


def _block_row(k_ref, g_ref, w0, b: int, start, length, h, neg_a, dt):
    """``row`` of :func:`_diag_block` for 16-row block ``b`` of the window at ``w0``
    (``"launch_rows"``): row ``j``'s k (not normalised: :func:`_diag_block` scales its
    columns) and gate, read from memory, zeros outside the chunk."""

    def row(j):
        tok = w0 + b * SUB + j
        ok = (tok >= start) & (tok < start + length)
        kj = pltr.load(k_ref.at[tok, h, :], mask=ok, other=0.0).astype(jnp.float32)
        gj = pltr.load(g_ref.at[tok, h, :], mask=ok, other=0.0).astype(jnp.float32)
        return kj, jnp.where(ok, neg_a * softplus_poly(gj + dt), 0.0)

    return row


def _gate_rows(g_ref, r, ok, h, neg_a, dt):
    """The gates ``-exp(A_log) softplus(g + dt_bias)`` of rows ``r`` (0 outside the chunk)."""
    gb = pltr.load(g_ref.at[r, h, :], mask=ok[:, None], other=0.0)
    return jnp.where(ok[:, None], neg_a * softplus_poly(gb.astype(jnp.float32) + dt), 0.0)


def _diag_kernel(
    c_start_ref, c_len_ref,  # i32[NC]
    neg_a_ref, dt_ref,  # f32[H], f32[H, Dk]
    q_ref, k_ref, g_ref,  # [Tp, H, Dk]
    dkk_ref, dqk_ref,  # f32[H, Tp, 16]  out: the diagonal blocks' rows (valid rows only)
    *, scale: float, tma_layout: bool, rows_from_memory: bool = False, mid: bool = False,
    precision=None, operand_dtype=jnp.float32,
):  # fmt: skip
    """``diag_form="launch"`` or ``"launch_rows"``: the diagonal blocks of Akk (before beta;
    diagonal and above unused) and Aqk (:func:`_diag_block`, a column at a time) in a launch of
    their own, one program per (chunk, 16-row block, head): the column loop's few tiles in a
    small program, many of them resident, out of the intra launch's register-capped one. The
    blocks' decays are differences within a block, so ``gam`` restarts at each.
    ``rows_from_memory`` (``"launch_rows"``): each column's row of k and of the gates read from
    memory. ``mid`` (``"mid"``): a block whose decay over its rows is at most
    :data:`MID_SPAN` by :func:`_mid_block`'s two products (``operand_dtype`` operands at
    ``precision``, as the intra launch's), another by the column loop read from memory."""
    ci, sb, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, length = c_start_ref[ci], c_len_ref[ci]
    w0 = window(start, length, q_ref.shape[0], CHUNK, aligned=tma_layout).rows.start
    lo = w0 + sb * SUB

    @pl.when((length > 0) & (lo < start + length) & (lo + SUB > start))
    def _():
        r, ok = sub_rows(w0, sb, SUB, start, length)
        q = pltr.load(q_ref.at[r, h, :], mask=ok[:, None], other=0.0)
        k = pltr.load(k_ref.at[r, h, :], mask=ok[:, None], other=0.0)
        gam = jnp.cumsum(_gate_rows(g_ref, r, ok, h, neg_a_ref[h], dt_ref[h, :]), axis=0)
        q = l2norm(q.astype(jnp.float32)) * scale
        k = k.astype(jnp.float32)
        inv_norm = jax.lax.rsqrt(jnp.sum(k * k, axis=1) + 1e-6)  # [16]: l2norm's
        row = col_scale = None
        if rows_from_memory:  # k's rows unnormalised in the loop, columns scaled after it
            row = _block_row(k_ref, g_ref, w0, sb, start, length, h, neg_a_ref[h], dt_ref[h, :])
            col_scale = inv_norm
        kn = k * inv_norm[:, None]
        if mid:  # (gam never increases: its first row less its last is the block's decay)
            span = jnp.max(_row(gam, 0) - _row(gam, SUB - 1))
            prod = operand_products(precision, operand_dtype)
            d_kk, d_qk = jax.lax.cond(
                span <= MID_SPAN,
                lambda: _mid_block(q, kn, gam, prod),
                lambda: _diag_block(q, kn, gam, row, col_scale),
            )
        else:
            d_kk, d_qk = _diag_block(q, kn, gam, row, col_scale)
        pltr.store(dkk_ref.at[h, r, :], d_kk, mask=ok[:, None])
        pltr.store(dqk_ref.at[h, r, :], d_qk, mask=ok[:, None])


def _intra_kernel(
    c_start_ref, c_len_ref,  # i32[NC]
    live_ref,  # i32[1]  the batch's token count (tma_layout: k_dec's rows after it are zeroed)
    neg_a_ref,  # f32[H]
    dt_ref,  # f32[H, Dk]
    q_ref, k_ref, g_ref,  # [Tp, H, Dk]
    v_ref,  # [Tp, H, Dv]
    b_ref,  # [Tp, H]
    *refs,
    # diag_form "launch(_rows)": dkk_ref, dqk_ref (f32[H, Tp, 16], _diag_kernel's), then
    # the outputs:
    # w_ref      [H, Tp, Dk]  W = Tm (beta k e^gam)    head-major, valid rows only
    # u_ref      [H, Tp, Dv]  U = Tm (beta v)  (tma_layout: U^T, [H, Dv, Tp])
    # qd_ref     [H, Tp, Dk]  q e^gam  (scaled, l2-normed q)
    # kd_ref     [H, Tp, Dk]  k e^(gam_last - gam)
    # aqk_ref    [H, Tp, C]   Aqk's row of the token, columns = the chunk's window rows
    # decay_ref  f32[NC, H, Dk]  e^gam_last
    scale: float, precision, operand_dtype, tma_layout: bool = False,
    diag_form: str = "columns",
):  # fmt: skip
    """Launch 1, one program per (chunk, head), all in parallel: the chunk's UT form and the
    decayed operands of the serial launch (module docstring), as
    :class:`~pallas_kernels.common.chunk_scan_gpu.ChunkRefs`. ``tma_layout``: the scratch of
    the Mosaic GPU serial launch, as GDN's (``gdn.gpu._intra_kernel``): the chunk's window is
    its 64-token block, ``U`` is stored transposed, ``k_dec`` zero on the rows after the
    batch's last token. With ``diag_form="launch(_rows)"`` the diagonal blocks' scores are read
    (:func:`_diag_kernel`'s), not made."""
    diag_refs = refs[:2] if diag_form != "columns" else None
    w_ref, u_ref, qd_ref, kd_ref, aqk_ref, decay_ref = refs[2:] if diag_refs else refs
    ci, h = pl.program_id(0), pl.program_id(1)
    start, length = c_start_ref[ci], c_len_ref[ci]
    num_tokens = q_ref.shape[0]
    dk = q_ref.shape[-1]
    ii = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
    jj = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
    op = operand_dtype
    opmm = operand_products(precision, op)  # a dot on operand_dtype operands

    @pl.when(length > 0)
    def _():
        w0 = window(start, length, num_tokens, CHUNK, aligned=tma_layout).rows.start
        neg_a, dt = neg_a_ref[h], dt_ref[h, :]
        # In the order that ends each tile's life soonest (a [16, Dk] f32 tile is 16 registers
        # a thread at 4 warps; holding q, k, gam and beta v of all four blocks spilled).
        # 1. Per 16-row block I (rows outside the chunk load zeros, g = beta = 0): its gate,
        # gam from the window's first row, the normalised rows, then its scores against the
        # blocks up to it, stored with q's rows: Akk and Aqk by [16, 16] blocks (I, J),
        # J <= I. Diagonal: _diag_block. Below it, factored through gam_ref, the
        # first row of block I: rows of I decay from it (e^(gam_i - gam_ref)), rows of J up to
        # it. Each block then keeps only two operand-dtype tiles, no gam: its rows decayed to
        # its last row, k e^(gam_end - gam), and W's operand, beta k e^gam. J's decay up to
        # gam_ref is then a vector, e^(gam_ref - gam_end_J) e^(gam_end_J - gam_j), as is k_dec's
        # e^(gam_last - gam_end) e^(gam_end - gam). Every exponent is <= 0: gam never
        # increases, and J's rows, then its last one, precede gam_ref's.
        rows, valid, beta, k_end, kb_dec, gam_end = [], [], [], [], [], []
        a_kk = {}
        carry = jnp.zeros((dk,), jnp.float32)
        # v read before any store: a load after a store waits for it (the compiler cannot
        # tell that they do not alias)
        blocks = [sub_rows(w0, bi, SUB, start, length) for bi in range(NSUB)]
        v_blocks = load_v_blocks(v_ref, *zip(*blocks), h)
        raw = []
        for r, ok in blocks:  # every block's inputs, in their own dtypes, before any store
            raw.append([pltr.load(x.at[r, h, :], mask=ok[:, None], other=0.0)
                        for x in (q_ref, k_ref, g_ref)] + [
                        pltr.load(b_ref.at[r, h], mask=ok, other=0.0)])  # fmt: skip
            if diag_refs is not None:  # made by _diag_kernel
                raw[-1] += [pltr.load(d.at[h, r, :], mask=ok[:, None], other=0.0)
                            for d in diag_refs]  # fmt: skip
        for bi in range(NSUB):
            r, ok = blocks[bi]
            qb, kb, graw, bb = raw[bi][:4]
            gb = jnp.where(ok[:, None], neg_a * softplus_poly(graw.astype(jnp.float32) + dt), 0.0)
            gam_i = carry[None, :] + jnp.cumsum(gb, axis=0)  # [16, Dk]
            carry = carry + jnp.sum(gb, axis=0)  # gam of the block's last row
            q_i = l2norm(qb.astype(jnp.float32)) * scale
            k_i = l2norm(kb.astype(jnp.float32))
            beta_i = jnp.where(ok, jax.nn.sigmoid(bb.astype(jnp.float32)), 0.0)
            rows.append(r)
            valid.append(ok)
            beta.append(beta_i)
            if diag_refs is not None:
                d_kk, d_qk = raw[bi][4:]
            else:
                d_kk, d_qk = _diag_block(q_i, k_i, gam_i)
            a_kk[bi, bi] = jnp.where(ii > jj, beta_i[:, None] * d_kk, 0.0)
            a_qk = {bi: d_qk}
            if bi > 0:
                gam_ref = _row(gam_i, 0)  # [Dk]
                to_ref = jnp.exp(gam_i - gam_ref[None, :])  # [16, Dk]
                qr_i, kr_i = q_i * to_ref, k_i * to_ref * beta_i[:, None]
                for bj in range(bi):
                    k_j = k_end[bj] * jnp.exp(gam_ref - gam_end[bj])[None, :]  # [16, Dk]
                    a_kk[bi, bj] = opmm(kr_i, k_j, NT)
                    a_qk[bj] = opmm(qr_i, k_j, NT)
            ok2 = ok[:, None]
            for bj in range(NSUB):  # Aqk is inclusive lower: the blocks above it are zeros
                blk = a_qk[bj] if bj <= bi else jnp.zeros((SUB, SUB), jnp.float32)
                cols = pl.ds(bj * SUB, SUB)
                pltr.store(aqk_ref.at[h, r, cols], blk.astype(aqk_ref.dtype), mask=ok2)
            pltr.store(qd_ref.at[h, r, :], (q_i * jnp.exp(gam_i)).astype(qd_ref.dtype), mask=ok2)
            k_end.append((k_i * jnp.exp(carry[None, :] - gam_i)).astype(op))
            kb_dec.append((k_i * (beta_i[:, None] * jnp.exp(gam_i))).astype(op))
            gam_end.append(carry)
        gam_last = carry  # [Dk]: the chunk's total log-decay (padding rows add 0)
        decay_ref[ci, h, :] = jnp.exp(gam_last)

        # 2. Tm = (I + Akk)^-1 by blocks: T_II = (I + A_II)^-1, then
        # T_IJ = -T_II sum_{J <= K < I} A_IK T_KJ (block forward substitution).
        t = block_unit_lower_inverse(a_kk, NSUB, precision)

        # 3. k's rows stored (zero outside the chunk)
        for b in range(NSUB):
            k_dec = k_end[b] * jnp.exp(gam_last - gam_end[b])[None, :]
            kd_ok = valid[b][:, None]
            if tma_layout:  # k_dec zero on the block's rows after the batch's last token
                tok = w0 + b * SUB + jnp.arange(SUB, dtype=jnp.int32)
                kd_ok = kd_ok | (tok >= live_ref[0])[:, None]
            pltr.store(kd_ref.at[h, rows[b], :], k_dec.astype(kd_ref.dtype), mask=kd_ok)

        # 4. W, then U (v's rows read for each product: no v tile kept live)
        store_blocked_w_u(
            t, kb_dec, rows, valid, beta, h, v_ref, w_ref, u_ref, opmm, tma_layout, v_blocks
        )  # fmt: skip


def intra_launch(
    q, k, v, g, b, neg_a, dt, plan, *, num_chunks: int, operand_dtype, precision,
    num_warps: int | None = None, num_stages: int = 2, tma_layout: bool = False,
    diag_form: str | None = None, interpret: bool = False,
) -> ChunkRefs:  # fmt: skip
    """Launch 1 (:func:`_intra_kernel`) over grid ``(NC, H)`` on inputs padded to at least one
    chunk (:func:`~pallas_kernels.common.delta_rule_gpu.pad_tokens`); ``tma_layout`` (the
    Mosaic GPU serial launch's scratch, on a token-aligned plan and tokens padded to a multiple
    of 64): ``U^T [H, Dv, Tp]``. ``diag_form``: how the diagonal blocks' scores are made, one
    of :data:`DIAG_FORMS` (None: :data:`DIAG_FORM`); ``num_warps`` None:
    :data:`INTRA_NUM_WARPS` if set, else the form's :data:`INTRA_WARPS`."""
    diag_form = DIAG_FORM if diag_form is None else diag_form
    if diag_form not in DIAG_FORMS:
        raise ValueError(f"diagonal block form {diag_form!r}: one of {DIAG_FORMS}")
    nw = num_warps or INTRA_NUM_WARPS or INTRA_WARPS[diag_form]
    tp, h, dk = q.shape
    dv = v.shape[2]
    op = operand_dtype
    kernel = functools.partial(
        _intra_kernel, scale=float(dk) ** -0.5, precision=precision, operand_dtype=op,
        tma_layout=tma_layout, diag_form=diag_form,
    )  # fmt: skip
    shapes = chunk_refs_shapes(h, tp, dk, dv, CHUNK, num_chunks, op, True, tma_layout)
    live = live_end(plan) if tma_layout else jnp.zeros(1, jnp.int32)
    diag = ()
    if diag_form != "columns":
        rows_from_memory = diag_form in ("launch_rows", "mid")
        diag = pl.pallas_call(
            functools.partial(
                _diag_kernel,
                scale=float(dk) ** -0.5,
                tma_layout=tma_layout,
                rows_from_memory=rows_from_memory,
                mid=diag_form == "mid",
                precision=precision,
                operand_dtype=op,
            ),
            grid=(num_chunks, NSUB, h),
            out_shape=[jax.ShapeDtypeStruct((h, tp, SUB), jnp.float32)] * 2,
            compiler_params=compiler_params(DIAG_NUM_WARPS or DIAG_WARPS[diag_form], 1),
            interpret=interpret,
            name="kda_prefill_diag_gpu",
        )(plan.start, plan.length, neg_a, dt, q, k, g)
    return ChunkRefs(
        *pl.pallas_call(
            kernel,
            grid=(num_chunks, h),
            out_shape=list(shapes),
            compiler_params=compiler_params(nw, num_stages),
            interpret=interpret,
            name="kda_prefill_intra_gpu",
        )(plan.start, plan.length, live, neg_a, dt, q, k, g, v, b, *diag)
    )


def kda_prefill(
    q: jax.Array,  # [T, H, Dk]  post-conv, before l2norm
    k: jax.Array,  # [T, H, Dk]
    v: jax.Array,  # [T, H, Dv]
    g: jax.Array,  # [T, H, Dk]  raw gate projection
    b: jax.Array,  # [T, H]
    A_log: jax.Array,  # f32[H]
    dt_bias: jax.Array,  # f32[H, Dk]
    state: jax.Array,  # f32 | bf16[num_slots, H, Dv, Dk]  donated: updated in place
    query_start_loc: jax.Array,  # i32[S+1]
    slots: StateSlots,  # DESIGN.md §3
    *,
    block_v: int | None = None,
    precision=jax.lax.Precision.HIGHEST,
    operand_dtype=None,
    num_warps: int = 4,
    num_stages: int = 2,
    intra_num_warps: int | None = None,
    intra_num_stages: int = 2,
    vb_first: bool = SERIAL_VB_FIRST,
    three_launches: bool = False,
    block_v_out: int | None = None,
    serial: str | None = None,
    diag_form: str | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Chunked ragged prefill; see the module docstring. Returns ``(o [T, H, Dv], state)``.

    ``serial`` picks the serial launch as for GDN (``gdn.gpu.gdn_prefill``): ``"triton"``,
    ``"mgpu"`` (Mosaic GPU, :mod:`pallas_kernels.common.chunk_scan_mgpu`, with the decay per
    key channel), or None (``chunk_scan_mgpu.SERIAL_DEFAULT``).

    ``precision`` is the matmul precision inside the chunk (``HIGHEST``: IEEE f32; None or
    ``DEFAULT``: TF32 on NVIDIA). ``operand_dtype`` (:func:`operand_dtype_for`: bf16 for bf16
    activations, float32 for float32 ones) is that of the dot operands after the gates (the
    off-diagonal scores, W, U, V', the decayed rows, Aqk) and of the scratch between launches,
    as FLA's ``chunk_kda`` runs; the inverse and the state carried between chunks stay f32.
    ``three_launches`` moves the output out of the serial launch into a parallel one, at the
    cost of a scratch of every chunk's starting state (``[NC, H, Dk, Dv]``). ``block_v``
    (default: :func:`~pallas_kernels.common.delta_rule_gpu.serial_block_v` by the launch's
    size), ``num_warps`` and ``num_stages`` tune the serial launch, ``intra_num_warps`` /
    ``intra_num_stages`` the intra launch (None warps: :func:`intra_launch`'s), ``vb_first``
    the serial grid's order
    (:func:`~pallas_kernels.common.delta_rule_gpu.serial_grid`), ``diag_form`` how the
    diagonal blocks' scores are made (:data:`DIAG_FORMS`; None: :data:`DIAG_FORM`).
    """
    _check(q, k, v, g, b, A_log, dt_bias, state, slots, query_start_loc)
    n, h, dk = q.shape
    dv = v.shape[2]
    rows, max_ckpt = slots.ckpt_offsets.shape
    op = operand_dtype_for(v.dtype, operand_dtype)
    prec = operand_precision(precision, op)
    bv = serial_block_v(rows, h, dv, block_v)
    neg_a, dt = -jnp.exp(A_log.astype(jnp.float32)), dt_bias.astype(jnp.float32)
    nc = max_chunks(n, rows, max_ckpt, CHUNK)
    mgpu = chunk_scan_mgpu.serial_is_mgpu(
        serial, dk, dv, nc, op, state.dtype, three_launches, interpret, True
    )
    plan = plan_chunks(query_start_loc, slots, num_tokens=n, chunk=CHUNK, token_aligned=mgpu)
    rp = row_plan(plan, slots, nc)
    # the 64-row window needs T >= 64; the Mosaic GPU launch's blocks a multiple of 64
    (q, k, g, v, b), _ = pad_tokens((q, k, g, v, b), CHUNK, CHUNK if mgpu else 1)
    x = intra_launch(
        q, k, v, g, b, neg_a, dt, plan, num_chunks=nc, operand_dtype=op, precision=precision,
        num_warps=intra_num_warps,
        num_stages=intra_num_stages,
        tma_layout=mgpu, diag_form=diag_form, interpret=interpret,
    )  # fmt: skip
    if mgpu:
        return chunk_scan_mgpu.scan_mgpu(
            rp, x, state, out_dtype=v.dtype, name="kda_prefill", live=plan.live,
            interpret=interpret,
        )  # fmt: skip
    o, state = scan_launches(
        rp, x, state, plan.start, plan.length, out_dtype=v.dtype, bv=bv, precision=prec,
        num_warps=num_warps, num_stages=num_stages, vb_first=vb_first,
        three_launches=three_launches, block_v_out=block_v_out, interpret=interpret,
        name="kda_prefill",
    )  # fmt: skip
    return jnp.where(plan.live[:, None, None], o[:n], 0).astype(v.dtype), state
