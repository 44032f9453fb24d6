"""KDA Pallas kernels for NVIDIA GPUs (Triton lowering), with explicit state slots.

Same signatures and semantics as :mod:`pallas_kernels.kda.reference` (DESIGN.md §3), the
same slot contract as the GDN kernels (:mod:`pallas_kernels.gdn.gpu`). The gate is computed
in the kernel: ``g = -exp(A_log[h]) * softplus(g_raw + dt_bias[h])``, one per key channel.
``interpret=True`` runs them with Pallas' generic interpreter on CPU (how CI tests them).

Decode (memory bound: one read of the source state, one write per destination)
------------------------------------------------------------------------------
grid = (S, H, Dv // BV); a program owns ``state[:, h, :, v0:v0+BV]`` of one row::

    S  = src > 0 ? pool[src, h, :, vblk] : 0           [Dk, BV] f32 (masked load)
    S  = diag(exp(g)) S;  S += k (beta (v - S^T k))^T;  o = S^T q
    pool[dst, h, :, vblk] = S and pool[ckpt_slots[m], ...] = S where ckpt_offsets[m] == 1

Prefill (chunked form, 16-token chunks, one program per row, head and Dv block)
-------------------------------------------------------------------------------
The per-channel decay sits inside the intra-chunk dot products, so they are not plain
matmuls. With 16-token chunks the pairwise decays fit in registers and are computed directly
and stably (``exp`` only of ``gam_i - gam_j <= 0``, the upper triangle selected away before
the ``exp``)::

    gam   = cumsum(g) over the chunk's rows           [C, Dk]   (a lower-ones matmul)
    E     = exp(gam_i - gam_j)  for i >= j, else 0     [C, C, Dk]
    Akk   = strict_lower(beta_i sum_d k_i k_j E)       Aqk = incl_lower(sum_d q_i k_j E)
    Tm    = (I + Akk)^-1                               recursive 2x2 block inversion
    W, U  = Tm (beta k exp(gam)), Tm (beta v)
    Vnew  = U - W S;   o = (q exp(gam)) S + Aqk Vnew
    S     = diag(exp(gam_last)) S + (k exp(gam_last - gam))^T Vnew

Chunks come from :mod:`pallas_kernels.common.chunking` (never straddling a sequence or a
checkpoint offset; the scheduler's offsets are multiples of 64, hence of 16). A chunk is read
as a 16-row window clamped into ``[0, T - 16]``; rows outside it are masked to zero, which is
exact (``g = beta = k = 0`` rows contribute nothing). Requirements: ``Dk`` a power of two,
``BV`` a power of two dividing ``Dv``, ``T >= 16`` (the wrapper pads shorter batches);
:func:`unsupported_reason` says which head dims ``hyjax.ops`` must leave to the reference.
FLA's ``chunk_kda`` uses 64-token chunks with 16-row sub-blocks and three kernels; this is the
simple first form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common.chunking import max_chunks, plan_chunks
from pallas_kernels.common.slots import StateSlots
from pallas_kernels.kda.reference import check_kda_args

CHUNK = 16
MIN_TILE = 8  # as pallas_kernels.gdn.gpu: the narrowest head-dim tile compiled on a GPU


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _block_v(dv: int, requested: int | None) -> int:
    """``requested``, else the largest power of two dividing Dv, at most 32."""
    bv = min(dv & -dv, 32) if requested is None else requested
    if not (_is_pow2(bv) and dv % bv == 0):
        raise ValueError(f"block_v={bv} must be a power of two dividing {dv=}")
    return bv


def unsupported_reason(dk: int, dv: int) -> str | None:
    """Why these kernels cannot take the head dims, or None (the GDN kernels' rule: a Triton
    tile holds all of Dk, and Dv in tiles of the largest power of two dividing it)."""
    if not (_is_pow2(dk) and dk >= MIN_TILE):
        return f"key head dim {dk} is not a power of two >= {MIN_TILE} (one Triton tile holds Dk)"
    if dv & -dv < MIN_TILE:
        return f"value head dim {dv} has no power-of-two tile of >= {MIN_TILE} columns"
    return None


def _softplus(x):
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def _l2norm(x, axis=-1):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=axis, keepdims=True) + 1e-6)


def _mm(x, y, contract, precision):
    return jax.lax.dot_general(
        x, y, (contract, ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def _check(q, k, v, g, b, A_log, dt_bias, state, slots, qsl=None):
    check_kda_args(q, k, v, g, b, A_log, dt_bias, state, slots, qsl)
    if not _is_pow2(q.shape[-1]):
        raise ValueError(f"Dk={q.shape[-1]} must be a power of two for the Triton kernels")


# ----------------------------------------------------------------------------- decode


def _decode_kernel(
    src_ref, dst_ref, ck_off_ref, ck_slot_ref, n_ref,  # i32[S], i32[S], i32[S, M] x2, i32[1]
    neg_a_ref,  # f32[H]: -exp(A_log)
    dt_ref,  # f32[H, Dk]
    q_ref, k_ref, g_ref,  # [S, H, Dk]
    v_ref,  # [S, H, Dv]
    b_ref,  # [S, H]
    pool_in,  # f32[num_slots, H, Dk, Dv]
    o_ref,  # [S, H, Dv]
    pool_out,  # aliased to pool_in
    *, bv: int, scale: float,
):  # fmt: skip
    r, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    vs = pl.ds(vb * bv, bv)
    dk = q_ref.shape[-1]
    live = r < n_ref[0]
    src, dst = src_ref[r], dst_ref[r]

    q = _l2norm(q_ref[r, h, :].astype(jnp.float32)) * scale  # [Dk]
    k = _l2norm(k_ref[r, h, :].astype(jnp.float32))
    v = v_ref[r, h, vs].astype(jnp.float32)  # [BV]
    decay = neg_a_ref[h] * _softplus(g_ref[r, h, :].astype(jnp.float32) + dt_ref[h, :])  # [Dk]
    beta = jax.nn.sigmoid(b_ref[r, h].astype(jnp.float32))
    read = jnp.full((dk, bv), live & (src > 0))
    s = pltr.load(pool_in.at[src, h, :, vs], mask=read, other=0.0)  # [Dk, BV]
    s = s * jnp.exp(decay)[:, None]
    pred = jnp.sum(s * k[:, None], axis=0)  # [BV] = S^T k
    s = s + k[:, None] * (beta * (v - pred))[None, :]
    o = jnp.sum(s * q[:, None], axis=0)
    o_ref[r, h, vs] = jnp.where(live, o, 0.0).astype(o_ref.dtype)

    pltr.store(pool_out.at[dst, h, :, vs], s, mask=jnp.full((dk, bv), live & (dst > 0)))
    for m in range(ck_off_ref.shape[1]):
        slot = ck_slot_ref[r, m]
        hit = live & (slot > 0) & (ck_off_ref[r, m] == 1)
        pltr.store(pool_out.at[slot, h, :, vs], s, mask=jnp.full((dk, bv), hit))


def kda_decode(
    q: jax.Array,  # [S, H, Dk]
    k: jax.Array,  # [S, H, Dk]
    v: jax.Array,  # [S, H, Dv]
    g: jax.Array,  # [S, H, Dk]  raw gate projection
    b: jax.Array,  # [S, H]
    A_log: jax.Array,  # f32[H]
    dt_bias: jax.Array,  # f32[H, Dk]
    state: jax.Array,  # f32[num_slots, H, Dk, Dv]  donated: updated in place
    slots: StateSlots,  # DESIGN.md §3
    *,
    block_v: int | None = None,
    num_warps: int = 4,
    num_stages: int = 1,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """One token per row; see the module docstring. Returns ``(o [S, H, Dv], state)``."""
    _check(q, k, v, g, b, A_log, dt_bias, state, slots)
    rows, h, dk = q.shape
    dv = v.shape[2]
    if rows != slots.num_rows:
        raise ValueError(f"decode rows {rows} must equal {slots.num_rows=} (one token each)")
    bv = _block_v(dv, block_v)
    args = (
        *slots.arrays(), -jnp.exp(A_log.astype(jnp.float32)), dt_bias.astype(jnp.float32),
        q, k, g, v, b, state,
    )  # fmt: skip
    return pl.pallas_call(
        functools.partial(_decode_kernel, bv=bv, scale=float(dk) ** -0.5),
        grid=(rows, h, dv // bv),
        out_shape=[
            jax.ShapeDtypeStruct((rows, h, dv), v.dtype),
            jax.ShapeDtypeStruct(state.shape, state.dtype),
        ],
        input_output_aliases={len(args) - 1: 1},
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kda_decode_gpu",
    )(*args)


# ----------------------------------------------------------------------------- prefill


def _unit_lower_inverse(a, ii, jj, mm):
    """``(I + a)^-1`` for strictly lower ``a``: recursive 2x2 block inversion.

    With ``x`` the block-diagonal inverse for blocks of ``s``, the inverse for blocks of
    ``2s`` is ``x - x c x``, ``c`` holding ``a``'s entries below the diagonal blocks.
    """
    n = a.shape[0]
    x = (ii == jj).astype(jnp.float32)
    s = 1
    while s < n:
        c = jnp.where((ii // (2 * s) == jj // (2 * s)) & (ii // s != jj // s), a, 0.0)
        x = x - mm(x, mm(c, x))
        s *= 2
    return x


def _prefill_kernel(
    row_first_ref, row_chunks_ref,  # i32[S]: first chunk of each row in the plan, chunk count
    c_start_ref, c_len_ref, c_end_ref,  # i32[NC]
    src_ref, dst_ref, ck_off_ref, ck_slot_ref,  # i32[S], i32[S], i32[S, M] x2
    neg_a_ref,  # f32[H]
    dt_ref,  # f32[H, Dk]
    q_ref, k_ref, g_ref,  # [Tp, H, Dk]
    v_ref,  # [Tp, H, Dv]
    b_ref,  # [Tp, H]
    pool_in,  # f32[num_slots, H, Dk, Dv]
    o_ref,  # [Tp, H, Dv]  (rows outside every chunk are left unwritten)
    pool_out,
    *, bv: int, scale: float, precision,
):  # fmt: skip
    r, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    vs = pl.ds(vb * bv, bv)
    num_tokens, _, dk = q_ref.shape
    n_chunks = row_chunks_ref[r]
    src, dst = src_ref[r], dst_ref[r]
    c = CHUNK
    ii = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    jj = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    lower_ones = (ii >= jj).astype(jnp.float32)
    neg_a = neg_a_ref[h]
    dt = dt_ref[h, :]  # [Dk]

    def mm(x, y, contract=((1,), (0,))):
        return _mm(x, y, contract, precision)

    read = jnp.full((dk, bv), (n_chunks > 0) & (src > 0))
    s0 = pltr.load(pool_in.at[src, h, :, vs], mask=read, other=0.0)  # [Dk, BV]

    def chunk_step(i, s):
        ci = row_first_ref[r] + i
        start, length, end = c_start_ref[ci], c_len_ref[ci], c_end_ref[ci]
        w0 = jnp.minimum(start, num_tokens - c)  # window start, clamped in bounds
        tok = w0 + jnp.arange(c, dtype=jnp.int32)
        valid = (tok >= start) & (tok < start + length)  # [C]
        rows_ok = valid[:, None]
        win = pl.ds(w0, c)
        q = pltr.load(q_ref.at[win, h, :], mask=rows_ok, other=0.0).astype(jnp.float32)
        k = pltr.load(k_ref.at[win, h, :], mask=rows_ok, other=0.0).astype(jnp.float32)
        graw = pltr.load(g_ref.at[win, h, :], mask=rows_ok, other=0.0).astype(jnp.float32)
        v = pltr.load(v_ref.at[win, h, vs], mask=rows_ok, other=0.0).astype(jnp.float32)
        b = pltr.load(b_ref.at[win, h], mask=valid, other=0.0).astype(jnp.float32)
        q = _l2norm(q) * scale
        k = _l2norm(k)
        g = jnp.where(rows_ok, neg_a * _softplus(graw + dt[None, :]), 0.0)  # [C, Dk]
        beta = jnp.where(valid, jax.nn.sigmoid(b), 0.0)  # [C]
        gam = mm(lower_ones, g)  # [C, Dk] inclusive cumsum over rows
        gam_last = jnp.sum(g, axis=0)  # [Dk]: masked rows have g = 0
        # Pairwise per-channel decays, selected to 0 above the diagonal before the exp.
        lower3 = (ii >= jj)[:, :, None]
        e = jnp.exp(jnp.where(lower3, gam[:, None, :] - gam[None, :, :], -1e30))  # [C, C, Dk]
        kj = k[None, :, :] * e
        a_kk = jnp.sum(k[:, None, :] * kj, axis=2)  # [C, C]
        a_qk = jnp.sum(q[:, None, :] * kj, axis=2)  # inclusive lower, 0 above
        a_kk = jnp.where(ii > jj, beta[:, None] * a_kk, 0.0)
        tm = _unit_lower_inverse(a_kk, ii, jj, mm)
        eg = jnp.exp(gam)  # [C, Dk]
        w = mm(tm, k * eg * beta[:, None])  # [C, Dk]
        u = mm(tm, v * beta[:, None])  # [C, BV]
        vnew = u - mm(w, s)
        o = mm(q * eg, s) + mm(a_qk, vnew)
        pltr.store(o_ref.at[win, h, vs], o.astype(o_ref.dtype), mask=rows_ok)
        k_dec = k * jnp.exp(gam_last[None, :] - gam)  # [C, Dk]
        s = s * jnp.exp(gam_last)[:, None] + mm(k_dec, vnew, ((0,), (0,)))
        for m in range(ck_off_ref.shape[1]):
            slot = ck_slot_ref[r, m]
            hit = (slot > 0) & (ck_off_ref[r, m] == end)
            pltr.store(pool_out.at[slot, h, :, vs], s, mask=jnp.full((dk, bv), hit))
        last = (i == n_chunks - 1) & (dst > 0)
        pltr.store(pool_out.at[dst, h, :, vs], s, mask=jnp.full((dk, bv), last))
        return s

    jax.lax.fori_loop(0, n_chunks, chunk_step, s0)


def kda_prefill(
    q: jax.Array,  # [T, H, Dk]  post-conv, before l2norm
    k: jax.Array,  # [T, H, Dk]
    v: jax.Array,  # [T, H, Dv]
    g: jax.Array,  # [T, H, Dk]  raw gate projection
    b: jax.Array,  # [T, H]
    A_log: jax.Array,  # f32[H]
    dt_bias: jax.Array,  # f32[H, Dk]
    state: jax.Array,  # f32[num_slots, H, Dk, Dv]  donated: updated in place
    query_start_loc: jax.Array,  # i32[S+1]
    slots: StateSlots,  # DESIGN.md §3
    *,
    block_v: int | None = None,
    precision=jax.lax.Precision.HIGHEST,
    num_warps: int = 8,  # best of the H200 sweep (BENCHMARKS.md): 2.8x faster than 4
    num_stages: int = 1,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Chunked ragged prefill; see the module docstring. Returns ``(o [T, H, Dv], state)``.

    ``precision`` is the matmul precision inside the chunk (``HIGHEST``: IEEE f32).
    """
    _check(q, k, v, g, b, A_log, dt_bias, state, slots, query_start_loc)
    n, h, dk = q.shape
    dv = v.shape[2]
    rows, max_ckpt = slots.ckpt_offsets.shape
    bv = _block_v(dv, block_v)
    plan = plan_chunks(query_start_loc, slots, num_tokens=n, chunk=CHUNK)
    nc = max_chunks(n, rows, max_ckpt, CHUNK)
    # Chunks of a row are consecutive in the plan: its first chunk and how many.
    is_first = (plan.first == 1) & (plan.length > 0)
    row_first = (
        jnp.zeros(rows, jnp.int32)
        .at[jnp.where(is_first, plan.seq, rows)]
        .set(jnp.arange(nc, dtype=jnp.int32), mode="drop")
    )
    row_chunks = jnp.zeros(rows, jnp.int32).at[plan.seq].add((plan.length > 0).astype(jnp.int32))
    pad = max(0, CHUNK - n)  # the 16-row window needs T >= 16

    def padded(x):
        return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) if pad else x

    args = (
        row_first, row_chunks, plan.start, plan.length, plan.end, *slots.arrays()[:4],
        -jnp.exp(A_log.astype(jnp.float32)), dt_bias.astype(jnp.float32),
        *map(padded, (q, k, g, v, b)), state,
    )  # fmt: skip
    kernel = functools.partial(_prefill_kernel, bv=bv, scale=float(dk) ** -0.5, precision=precision)
    o, state = pl.pallas_call(
        kernel,
        grid=(rows, h, dv // bv),
        out_shape=[
            jax.ShapeDtypeStruct((n + pad, h, dv), v.dtype),
            jax.ShapeDtypeStruct(state.shape, state.dtype),
        ],
        input_output_aliases={len(args) - 1: 1},
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kda_prefill_gpu",
    )(*args)
    return jnp.where(plan.live[:, None, None], o[:n], 0).astype(v.dtype), state
