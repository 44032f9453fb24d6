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

Prefill (chunked WY/UT form, three launches)
--------------------------------------------
The per-channel decay sits inside the intra-chunk dot products, so they are not plain
matmuls. Chunks of at most 64 tokens, read as 64-row windows (``T >= 64``: the wrapper pads)
of four 16-row sub-blocks; ``gam = cumsum(g)`` from the window's first row (rows outside the
chunk have ``g = beta = 0`` and zero q/k/v, so ``gam`` restarts at the chunk)::

    Akk[i, j] = beta_i sum_d k_id k_jd e^(gam_id - gam_jd)   (i > j)    Aqk: q_i, i >= j

1. ``_intra_kernel``, grid = (NC, H), every chunk in parallel. Akk and Aqk by ``[16, 16]``
   blocks (I, J), every ``exp`` argument <= 0:

   - diagonal blocks (I = J): one column ``j`` at a time, ``e^(gam_i - gam_j)`` for rows
     ``i >= j`` as a ``[16, Dk]`` tile (elementwise f32);
   - blocks below it (J < I): factored through ``gam_r``, the first row of block I:
     ``(q_i e^(gam_i - gam_r)) . (k_j e^(gam_r - gam_j))``, a ``[16, Dk] x [Dk, 16]`` dot.
     ``gam`` never increases (``g <= 0``) and J's rows precede ``r``, so both exponents are
     <= 0: a product that underflows is one whose true value does.

   Then ``Tm = (I + Akk)^-1`` by blocks (``T_II = unit_lower_inverse(A_II)``,
   ``T_IJ = -T_II sum_{J<=K<I} A_IK T_KJ``), ``W = Tm (beta k e^gam)``, ``U = Tm (beta v)``.
   Stored token-major (valid rows only, so the scratch scales with the tokens): W, U,
   ``q e^gam``, ``k e^(gam_last - gam)``, Aqk (``[T, H, 64]``, columns = window rows; the
   blocks above the diagonal are never written), and ``e^gam_last`` per chunk.
2. ``_state_kernel``, one program per (row, head, Dv block) (``serial_grid``: the blocks on
   the fastest axis): a program walks its row's chunks in order
   (:func:`~pallas_kernels.common.delta_rule_gpu.scan_row_chunks`: slot loads, checkpoint
   and ``dst`` stores, the tile transposed where it meets the pool) with ``S [Dk, BV]`` in
   registers, storing each chunk's starting state
   ``h`` (``[NC, H, Dk, Dv]``) and ``Vnew = U - W S``; then
   ``S = diag(e^gam_last) S + (k e^(gam_last - gam))^T Vnew``. Two Dk x BV matmuls a chunk.
3. ``_output_kernel``, grid = (NC, H, Dv // BV_out), in parallel:
   ``o = (q e^gam) h + Aqk Vnew``.

``operand_dtype=jnp.bfloat16`` casts the dot operands (W, U, Vnew, the decayed rows, Aqk,
``h``) to bf16 with f32 accumulation and stores that scratch in bf16, as FLA's ``chunk_kda``
runs; the carried state and the inverse stay f32. ``three_launches=False`` (the default only
when ``h`` would exceed ``max_scratch_bytes``) runs the earlier single serial launch: 16-token
chunks, the whole chunk step (decays ``[C, C, Dk]`` in registers, the inverse, W, U, o, S)
inside the per-(row, head, Dv block) scan, recomputed per Dv block. :func:`unsupported_reason`
says which head dims ``hyjax.ops`` must leave to the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common.chunking import max_chunks, plan_chunks
from pallas_kernels.common.delta_rule import (
    NN,
    NT,
    TN,
    GatedChunk,
    delta_rule_chunk,
    group_refs,
    l2norm,
    mm,
    softplus,
    unit_lower_inverse,
)
from pallas_kernels.common.delta_rule_gpu import (
    DECODE_BLOCK_V,
    DECODE_NUM_WARPS,
    SERIAL_VB_FIRST,
    DecodeSlots,
    RowPlan,
    check_key_dim,
    compiler_params,
    decode_program,
    launch_decode,
    operand_dtype_for,
    pad_tokens,
    pick_block_v,
    row_plan,
    scan_row_chunks,
    serial_grid,
    serial_ids,
    window,
)
from pallas_kernels.common.delta_rule_gpu import unsupported_reason as unsupported_reason
from pallas_kernels.common.slots import StateSlots
from pallas_kernels.kda.reference import check_kda_args

CHUNK = 64  # the three-launch path: 64-token chunks of four 16-row sub-blocks
SUB = 16
NSUB = CHUNK // SUB
SERIAL_CHUNK = 16  # the single-launch path


def _operand_precision(precision, operand_dtype):
    """The precision of a dot on ``operand_dtype`` operands: ``precision`` for f32; HIGHEST
    for bf16, which the Triton lowering turns into a plain bf16 MMA (DEFAULT would request
    TF32 inputs) and the CPU interpreter into a bf16 product accumulated in f32."""
    return precision if operand_dtype == jnp.float32 else jax.lax.Precision.HIGHEST


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
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """One token per row; see the module docstring. Returns ``(o [S, H, Dv], state)``."""
    _check(q, k, v, g, b, A_log, dt_bias, state, slots)
    rows, h, dk = q.shape
    dv = v.shape[2]
    if rows != slots.num_rows:
        raise ValueError(f"decode rows {rows} must equal {slots.num_rows=} (one token each)")
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


# ----------------------------------------------------------------------------- prefill: 1 launch


def _serial_kernel(
    p: RowPlan,
    neg_a_ref,  # f32[H]
    dt_ref,  # f32[H, Dk]
    q_ref, k_ref, g_ref,  # [Tp, H, Dk]
    v_ref,  # [Tp, H, Dv]
    b_ref,  # [Tp, H]
    pool_in,  # f32 | bf16[num_slots, H, Dv, Dk]
    o_ref,  # [Tp, H, Dv]  (rows outside every chunk are left unwritten)
    pool_out,
    *, bv: int, scale: float, precision, vb_first: bool,
):  # fmt: skip
    """The single-launch path: the whole 16-token chunk step inside the serial scan."""
    r, h, vb = serial_ids(vb_first)
    vs = pl.ds(vb * bv, bv)
    num_tokens = q_ref.shape[0]
    c = SERIAL_CHUNK
    ii = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    jj = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    lower_ones = (ii >= jj).astype(jnp.float32)
    neg_a = neg_a_ref[h]
    dt = dt_ref[h, :]  # [Dk]

    def step(ci, win, s):
        valid = win.valid  # [C]
        rows_ok = valid[:, None]
        q = pltr.load(q_ref.at[win.rows, h, :], mask=rows_ok, other=0.0).astype(jnp.float32)
        k = pltr.load(k_ref.at[win.rows, h, :], mask=rows_ok, other=0.0).astype(jnp.float32)
        graw = pltr.load(g_ref.at[win.rows, h, :], mask=rows_ok, other=0.0).astype(jnp.float32)
        v = pltr.load(v_ref.at[win.rows, h, vs], mask=rows_ok, other=0.0).astype(jnp.float32)
        b = pltr.load(b_ref.at[win.rows, h], mask=valid, other=0.0).astype(jnp.float32)
        q = l2norm(q) * scale
        k = l2norm(k)
        g = jnp.where(rows_ok, neg_a * softplus(graw + dt[None, :]), 0.0)  # [C, Dk]
        beta = jnp.where(valid, jax.nn.sigmoid(b), 0.0)  # [C]
        gam = mm(lower_ones, g, precision=precision)  # [C, Dk] inclusive cumsum over rows
        gam_last = jnp.sum(g, axis=0)  # [Dk]: masked rows have g = 0
        # Pairwise per-channel decays, selected to 0 above the diagonal before the exp.
        lower3 = (ii >= jj)[:, :, None]
        e = jnp.exp(jnp.where(lower3, gam[:, None, :] - gam[None, :, :], -1e30))  # [C, C, Dk]
        kj = k[None, :, :] * e
        a_kk = jnp.sum(k[:, None, :] * kj, axis=2)  # [C, C]
        a_qk = jnp.sum(q[:, None, :] * kj, axis=2)  # inclusive lower, 0 above
        eg = jnp.exp(gam)  # [C, Dk]
        gc = GatedChunk(
            a_kk=jnp.where(ii > jj, beta[:, None] * a_kk, 0.0),
            a_qk=a_qk,
            q_dec=q * eg,
            kb_dec=k * eg * beta[:, None],
            k_dec=k * jnp.exp(gam_last[None, :] - gam),  # [C, Dk]
            s_decay=jnp.exp(gam_last)[:, None],
        )
        o, s = delta_rule_chunk(gc, v * beta[:, None], s, precision)
        pltr.store(o_ref.at[win.rows, h, vs], o.astype(o_ref.dtype), mask=rows_ok)
        return s

    scan_row_chunks(
        p, pool_in, pool_out, r=r, h=h, vs=vs, num_tokens=num_tokens, chunk=SERIAL_CHUNK,
        step=step,
    )  # fmt: skip


# ----------------------------------------------------------------------------- prefill: 3 launches


def _sub_rows(w0, b: int, start, length):
    """Sub-block ``b`` of a window starting at ``w0``: its 16 rows and their valid mask."""
    tok = w0 + b * SUB + jnp.arange(SUB, dtype=jnp.int32)
    return pl.ds(w0 + b * SUB, SUB), (tok >= start) & (tok < start + length)


def _row(x, i: int):
    """Row ``i`` of a ``[16, D]`` tile as ``[D]`` (a masked sum: Triton has no value slicing)."""
    sel = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0) == i
    return jnp.sum(jnp.where(sel, x, 0.0), axis=0)


def _diag_block(q, k, gam):
    """The diagonal ``[16, 16]`` blocks of ``sum_d k_id k_jd e_ij`` and ``sum_d q_id k_jd
    e_ij`` (``i >= j``, 0 above), one column ``j`` at a time so that every ``exp`` argument
    ``gam_i - gam_j`` is <= 0."""
    ri = jax.lax.broadcasted_iota(jnp.int32, (SUB, 1), 0)
    cj = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)

    def column(j, acc):
        a_kk, a_qk = acc
        sel = jax.lax.broadcasted_iota(jnp.int32, gam.shape, 0) == j
        gam_j = jnp.sum(jnp.where(sel, gam, 0.0), axis=0)  # [Dk]
        k_j = jnp.sum(jnp.where(sel, k, 0.0), axis=0)
        e = jnp.exp(jnp.where(ri >= j, gam - gam_j[None, :], -1e30))  # [16, Dk], rows >= j
        kj_e = e * k_j[None, :]
        a_kk = jnp.where(cj == j, jnp.sum(k * kj_e, axis=1)[:, None], a_kk)
        a_qk = jnp.where(cj == j, jnp.sum(q * kj_e, axis=1)[:, None], a_qk)
        return a_kk, a_qk

    zero = jnp.zeros((SUB, SUB), jnp.float32)
    return jax.lax.fori_loop(0, SUB, column, (zero, zero))


def _intra_kernel(
    c_start_ref, c_len_ref,  # i32[NC]
    neg_a_ref,  # f32[H]
    dt_ref,  # f32[H, Dk]
    q_ref, k_ref, g_ref,  # [Tp, H, Dk]
    v_ref,  # [Tp, H, Dv]
    b_ref,  # [Tp, H]
    w_ref,  # [Tp, H, Dk]   out: W = Tm (beta k e^gam)        token-major, valid rows only
    u_ref,  # [Tp, H, Dv]   out: U = Tm (beta v)
    qd_ref,  # [Tp, H, Dk]  out: q e^gam  (scaled, l2-normed q)
    kd_ref,  # [Tp, H, Dk]  out: k e^(gam_last - gam)
    aqk_ref,  # [Tp, H, C]  out: Aqk's row of the token, columns = the chunk's window rows
    decay_ref,  # f32[NC, H, Dk]  out: e^gam_last
    *, scale: float, precision, operand_dtype,
):  # fmt: skip
    """Launch 1, one program per (chunk, head), all in parallel: the chunk's UT form and the
    decayed operands of the other two launches (module docstring)."""
    ci, h = pl.program_id(0), pl.program_id(1)
    start, length = c_start_ref[ci], c_len_ref[ci]
    num_tokens = q_ref.shape[0]
    dk, dv = q_ref.shape[-1], v_ref.shape[-1]
    ii = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
    jj = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
    op = operand_dtype
    op_prec = _operand_precision(precision, op)

    def opmm(x, y, contract=NN):  # a dot on operand_dtype operands, f32 accumulation
        return mm(x.astype(op), y.astype(op), contract, op_prec)

    @pl.when(length > 0)
    def _():
        w0 = window(start, length, num_tokens, CHUNK).rows.start
        neg_a, dt = neg_a_ref[h], dt_ref[h, :]
        # Per sub-block b (16 rows): the gate, its cumsum from the window's first row, the
        # normalised rows. Rows outside the chunk load zeros and get g = beta = 0.
        rows, valid, q, k, beta, gam = [], [], [], [], [], []
        carry = jnp.zeros((dk,), jnp.float32)
        for b in range(NSUB):
            r, ok = _sub_rows(w0, b, start, length)
            qb = pltr.load(q_ref.at[r, h, :], mask=ok[:, None], other=0.0)
            kb = pltr.load(k_ref.at[r, h, :], mask=ok[:, None], other=0.0)
            gb = pltr.load(g_ref.at[r, h, :], mask=ok[:, None], other=0.0)
            bb = pltr.load(b_ref.at[r, h], mask=ok, other=0.0)
            gb = jnp.where(ok[:, None], neg_a * softplus(gb.astype(jnp.float32) + dt), 0.0)
            gam.append(carry[None, :] + jnp.cumsum(gb, axis=0))  # [16, Dk]
            carry = carry + jnp.sum(gb, axis=0)
            rows.append(r)
            valid.append(ok)
            q.append(l2norm(qb.astype(jnp.float32)) * scale)
            k.append(l2norm(kb.astype(jnp.float32)))
            beta.append(jnp.where(ok, jax.nn.sigmoid(bb.astype(jnp.float32)), 0.0))
        gam_last = carry  # [Dk]: the chunk's total log-decay (padding rows add 0)
        decay_ref[ci, h, :] = jnp.exp(gam_last)

        # Akk and Aqk by [16, 16] blocks (I, J), J <= I. Diagonal: column by column.
        # Below it, factored through the first row of block I (gam_ref): rows of I decay
        # from gam_ref (e^(gam_i - gam_ref)), rows of J up to it (e^(gam_ref - gam_j)); both
        # exponents are <= 0 because gam never increases and J's rows precede gam_ref's.
        a_kk = {}
        a_qk = {}
        for bi in range(NSUB):
            d_kk, d_qk = _diag_block(q[bi], k[bi], gam[bi])
            a_kk[bi, bi] = jnp.where(ii > jj, beta[bi][:, None] * d_kk, 0.0)
            a_qk[bi, bi] = d_qk
            if bi == 0:
                continue
            gam_ref = _row(gam[bi], 0)  # [Dk]
            to_ref = jnp.exp(gam[bi] - gam_ref[None, :])  # [16, Dk]
            q_i, kb_i = q[bi] * to_ref, k[bi] * to_ref * beta[bi][:, None]
            for bj in range(bi):
                k_j = k[bj] * jnp.exp(gam_ref[None, :] - gam[bj])  # [16, Dk]
                a_kk[bi, bj] = opmm(kb_i, k_j, NT)
                a_qk[bi, bj] = opmm(q_i, k_j, NT)

        # Tm = (I + Akk)^-1 by blocks: T_II = (I + A_II)^-1, then
        # T_IJ = -T_II sum_{J <= K < I} A_IK T_KJ (block forward substitution).
        t = {}
        for bi in range(NSUB):
            t[bi, bi] = unit_lower_inverse(a_kk[bi, bi], precision)
            for bj in range(bi - 1, -1, -1):
                acc = sum(mm(a_kk[bi, m], t[m, bj], precision=precision) for m in range(bj, bi))
                t[bi, bj] = -mm(t[bi, bi], acc, precision=precision)

        kb_dec = [k[b] * (beta[b][:, None] * jnp.exp(gam[b])) for b in range(NSUB)]
        bv = dv & -dv  # Dv itself when a power of two (one tile), else its largest such divisor
        v_beta = {}
        for b in range(NSUB):
            for vb in range(dv // bv):
                vs = pl.ds(vb * bv, bv)
                vt = pltr.load(v_ref.at[rows[b], h, vs], mask=valid[b][:, None], other=0.0)
                v_beta[b, vb] = vt.astype(jnp.float32) * beta[b][:, None]
        for bi in range(NSUB):
            r, ok = rows[bi], valid[bi][:, None]
            w = sum(opmm(t[bi, bj], kb_dec[bj]) for bj in range(bi + 1))  # [16, Dk]
            pltr.store(w_ref.at[r, h, :], w.astype(w_ref.dtype), mask=ok)
            for vb in range(dv // bv):
                u = sum(opmm(t[bi, bj], v_beta[bj, vb]) for bj in range(bi + 1))  # [16, BV]
                pltr.store(u_ref.at[r, h, pl.ds(vb * bv, bv)], u.astype(u_ref.dtype), mask=ok)
            q_dec = q[bi] * jnp.exp(gam[bi])
            k_dec = k[bi] * jnp.exp(gam_last[None, :] - gam[bi])
            pltr.store(qd_ref.at[r, h, :], q_dec.astype(qd_ref.dtype), mask=ok)
            pltr.store(kd_ref.at[r, h, :], k_dec.astype(kd_ref.dtype), mask=ok)
            for bj in range(bi + 1):  # the blocks above are never written: see _output_kernel
                cols = pl.ds(bj * SUB, SUB)
                pltr.store(aqk_ref.at[r, h, cols], a_qk[bi, bj].astype(aqk_ref.dtype), mask=ok)


def _state_kernel(
    p: RowPlan,
    w_ref,  # [Tp, H, Dk]
    u_ref,  # [Tp, H, Dv]
    kd_ref,  # [Tp, H, Dk]
    decay_ref,  # f32[NC, H, Dk]
    pool_in,  # f32 | bf16[num_slots, H, Dv, Dk]
    h_ref,  # [NC, H, Dk, Dv]  out: the state before each chunk
    vnew_ref,  # [Tp, H, Dv]    out: Vnew = U - W S, token-major
    pool_out,
    *, bv: int, precision, operand_dtype, vb_first: bool,
):  # fmt: skip
    """Launch 2, one program per (row, head, Dv block): only the state recurrence is serial."""
    r, h, vb = serial_ids(vb_first)
    vs = pl.ds(vb * bv, bv)
    num_tokens = w_ref.shape[0]
    op = operand_dtype
    op_prec = _operand_precision(precision, op)

    def step(ci, win, s):
        ok = win.valid[:, None]
        s_op = s.astype(op)
        h_ref[ci, h, :, vs] = s_op.astype(h_ref.dtype)
        w = pltr.load(w_ref.at[win.rows, h, :], mask=ok, other=0.0)  # [C, Dk]
        u = pltr.load(u_ref.at[win.rows, h, vs], mask=ok, other=0.0)  # [C, BV]
        k_dec = pltr.load(kd_ref.at[win.rows, h, :], mask=ok, other=0.0)  # [C, Dk]
        vnew = u.astype(jnp.float32) - mm(w.astype(op), s_op, precision=op_prec)  # [C, BV]
        vnew = vnew.astype(op)
        pltr.store(vnew_ref.at[win.rows, h, vs], vnew.astype(vnew_ref.dtype), mask=ok)
        decay = decay_ref[ci, h, :]  # [Dk]
        return s * decay[:, None] + mm(k_dec.astype(op), vnew, TN, op_prec)

    scan_row_chunks(
        p, pool_in, pool_out, r=r, h=h, vs=vs, num_tokens=num_tokens, chunk=CHUNK, step=step
    )


def _output_kernel(
    c_start_ref, c_len_ref,  # i32[NC]
    qd_ref,  # [Tp, H, Dk]
    aqk_ref,  # [Tp, H, C]
    h_ref,  # [NC, H, Dk, Dv]
    vnew_ref,  # [Tp, H, Dv]
    o_ref,  # [Tp, H, Dv]
    *, bv: int, precision, operand_dtype,
):  # fmt: skip
    """Launch 3, every (chunk, head, Dv block) in parallel: ``o = (q e^gam) h + Aqk Vnew``."""
    ci, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    vs = pl.ds(vb * bv, bv)
    start, length = c_start_ref[ci], c_len_ref[ci]
    op = operand_dtype
    op_prec = _operand_precision(precision, op)

    @pl.when(length > 0)
    def _():
        win = window(start, length, qd_ref.shape[0], CHUNK)
        ok = win.valid[:, None]
        q_dec = pltr.load(qd_ref.at[win.rows, h, :], mask=ok, other=0.0)  # [C, Dk]
        a_qk = pltr.load(aqk_ref.at[win.rows, h, :], mask=ok, other=0.0)  # [C, C]
        # Above the diagonal blocks the scratch was never written: select, don't multiply.
        ii = jax.lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0)
        jj = jax.lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1)
        a_qk = jnp.where(ii >= jj, a_qk, 0.0)
        vnew = pltr.load(vnew_ref.at[win.rows, h, vs], mask=ok, other=0.0)  # [C, BV]
        s = h_ref[ci, h, :, vs]  # [Dk, BV]
        o = mm(q_dec.astype(op), s.astype(op), precision=op_prec)
        o = o + mm(a_qk.astype(op), vnew.astype(op), precision=op_prec)
        pltr.store(o_ref.at[win.rows, h, vs], o.astype(o_ref.dtype), mask=ok)


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
    block_v_out: int | None = None,
    precision=jax.lax.Precision.HIGHEST,
    operand_dtype=None,
    three_launches: bool | None = None,
    max_scratch_bytes: int = 512 * 1024 * 1024,
    num_warps: int | None = None,
    num_stages: int | None = None,
    intra_num_warps: int = 8,
    vb_first: bool = SERIAL_VB_FIRST,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Chunked ragged prefill; see the module docstring. Returns ``(o [T, H, Dv], state)``.

    ``precision`` is the matmul precision inside the chunk (``HIGHEST``: IEEE f32; None or
    ``DEFAULT``: TF32 on NVIDIA). ``operand_dtype`` (three-launch path only): None keeps every
    dot's operands in f32; ``jnp.bfloat16`` casts the operands of the intra-chunk and
    recurrence dots (W, U, Vnew, the decayed q/k rows, Aqk, the chunk states) to bf16 with f32
    accumulation and stores those scratch arrays in bf16, as FLA's ``chunk_kda`` runs; the
    state carried between chunks stays f32. ``three_launches`` (default: when the scratch of
    every chunk's starting state, ``[NC, H, Dk, Dv]``, fits ``max_scratch_bytes``) picks the
    parallel/serial/parallel path; False runs the single serial launch of 16-token chunks.
    ``block_v`` / ``block_v_out`` are the Dv tiles of the serial and output launches;
    ``num_warps`` / ``num_stages`` their launch parameters (default 4 / 2; the single launch:
    8 / 1), ``intra_num_warps`` the intra launch's (it holds a whole chunk: four 16-row
    sub-blocks of q, k, gam and v). None of these is tuned on a GPU yet. ``vb_first``: the
    serial launch's grid order (:func:`~pallas_kernels.common.delta_rule_gpu.serial_grid`).
    """
    _check(q, k, v, g, b, A_log, dt_bias, state, slots, query_start_loc)
    n, h, dk = q.shape
    dv = v.shape[2]
    rows, max_ckpt = slots.ckpt_offsets.shape
    op = operand_dtype_for(v.dtype, operand_dtype)
    if three_launches is None:
        nc = max_chunks(n, rows, max_ckpt, CHUNK)
        three_launches = nc * h * dk * dv * op.itemsize <= max_scratch_bytes
    neg_a, dt = -jnp.exp(A_log.astype(jnp.float32)), dt_bias.astype(jnp.float32)
    if not three_launches:
        return _prefill_serial(
            q, k, v, g, b, neg_a, dt, state, query_start_loc, slots, block_v=block_v,
            precision=precision, num_warps=num_warps or 8, num_stages=num_stages or 1,
            vb_first=vb_first, interpret=interpret,
        )  # fmt: skip
    bv = pick_block_v(dv, block_v)
    bo = pick_block_v(dv, block_v_out, default=64)
    plan = plan_chunks(query_start_loc, slots, num_tokens=n, chunk=CHUNK)
    nc = max_chunks(n, rows, max_ckpt, CHUNK)
    (q, k, g, v, b), tp = pad_tokens((q, k, g, v, b), CHUNK)  # the 64-row window needs T >= 64
    params = compiler_params(num_warps or 4, num_stages or 2)
    kw = dict(precision=precision, operand_dtype=op)
    sd = jax.ShapeDtypeStruct
    w, u, q_dec, k_dec, a_qk, decay = pl.pallas_call(
        functools.partial(_intra_kernel, scale=float(dk) ** -0.5, **kw),
        grid=(nc, h),
        out_shape=[
            sd((tp, h, dk), op),
            sd((tp, h, dv), op),
            sd((tp, h, dk), op),
            sd((tp, h, dk), op),
            sd((tp, h, CHUNK), op),
            sd((nc, h, dk), jnp.float32),
        ],  # fmt: skip
        compiler_params=compiler_params(intra_num_warps, num_stages or 2),
        interpret=interpret,
        name="kda_prefill_intra_gpu",
    )(plan.start, plan.length, neg_a, dt, q, k, g, v, b)
    args = (*row_plan(plan, slots, nc), w, u, k_dec, decay, state)
    h_all, vnew, state = pl.pallas_call(
        group_refs(_state_kernel, RowPlan, bv=bv, vb_first=vb_first, **kw),
        grid=serial_grid(rows, h, dv // bv, vb_first),
        out_shape=[sd((nc, h, dk, dv), op), sd((tp, h, dv), op), sd(state.shape, state.dtype)],
        input_output_aliases={len(args) - 1: 2},
        compiler_params=params,
        interpret=interpret,
        name="kda_prefill_state_gpu",
    )(*args)
    o = pl.pallas_call(
        functools.partial(_output_kernel, bv=bo, **kw),
        grid=(nc, h, dv // bo),
        out_shape=sd((tp, h, dv), v.dtype),
        compiler_params=params,
        interpret=interpret,
        name="kda_prefill_output_gpu",
    )(plan.start, plan.length, q_dec, a_qk, h_all, vnew)
    return jnp.where(plan.live[:, None, None], o[:n], 0).astype(v.dtype), state


def _prefill_serial(
    q, k, v, g, b, neg_a, dt, state, query_start_loc, slots, *, block_v, precision, num_warps,
    num_stages, vb_first, interpret,
):  # fmt: skip
    """The single-launch path (``three_launches=False``): :func:`_serial_kernel`."""
    n, h, dk = q.shape
    dv = v.shape[2]
    rows, max_ckpt = slots.ckpt_offsets.shape
    bv = pick_block_v(dv, block_v)
    plan = plan_chunks(query_start_loc, slots, num_tokens=n, chunk=SERIAL_CHUNK)
    nc = max_chunks(n, rows, max_ckpt, SERIAL_CHUNK)
    tokens, tp = pad_tokens((q, k, g, v, b), SERIAL_CHUNK)  # the 16-row window needs T >= 16
    args = (*row_plan(plan, slots, nc), neg_a, dt, *tokens, state)
    kernel = group_refs(
        _serial_kernel, RowPlan, bv=bv, scale=float(dk) ** -0.5, precision=precision,
        vb_first=vb_first,
    )  # fmt: skip
    o, state = pl.pallas_call(
        kernel,
        grid=serial_grid(rows, h, dv // bv, vb_first),
        out_shape=[
            jax.ShapeDtypeStruct((tp, h, dv), v.dtype),
            jax.ShapeDtypeStruct(state.shape, state.dtype),
        ],
        input_output_aliases={len(args) - 1: 1},
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="kda_prefill_gpu",
    )(*args)
    return jnp.where(plan.live[:, None, None], o[:n], 0).astype(v.dtype), state
