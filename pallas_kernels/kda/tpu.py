"""KDA Pallas kernels for TPU (Mosaic), with explicit state slots (DESIGN.md §3).

Same signatures and semantics as :mod:`pallas_kernels.kda.reference`; ``interpret`` is
passed to ``pallas_call`` (``pltpu.InterpretParams()`` runs them on CPU: how CI tests them).
The layout follows :mod:`pallas_kernels.gdn.tpu`; what differs is the per-channel decay.

Prefill: 16-token chunks, right-aligned blocks, the state in VMEM
-----------------------------------------------------------------
The ragged batch is cut into chunks (:mod:`pallas_kernels.common.chunking`) and gathered
head-major into right-aligned blocks; ``dt_bias`` is added to the raw gate in that same pass::

    q, k, g + dt_bias [T, H, Dk] --> [H, NC, 16, Dk]      b [T, H] --> [H, NC, 16, 1]
    v [T, H, Dv]                 --> [H, NC, 16, Dv]      o [H, NC, 16, Dv] --> [T, H, Dv]

    grid = (H // HB "parallel", NC "arbitrary")      state of HB heads: VMEM scratch f32

    first chunk of a row:   state <- pool[src]  (DMA; zeros when src == 0)
    every chunk:            state, o <- chunk step, per head of the block
    end == ckpt offset:     pool[ckpt slot] <- state;   last chunk: pool[dst] <- state

The chunk step keeps every ``exp`` argument <= 0: the pairwise decays
``exp(gam_i - gam_j)`` (i >= j) are built one column ``j`` at a time as ``[16, Dk]`` tiles
(2-D, VPU), which is what makes the decay inside the dot products exact and stable::

    gam        = cumsum(g)                         lower-ones matmul, [C, Dk]
    col j:     e_j = exp(gam - gam_j) (rows >= j) Akk[:, j] = beta (k e_j) k_j
                                                   Aqk[:, j] = (q e_j) k_j
    Tm = (I + Akk)^-1;  W = Tm (beta k exp(gam));  U = Tm (beta v);  Vnew = U - W S
    o = (q exp(gam)) S + Aqk Vnew;   S = diag(exp(gam_last)) S + (k exp(gam_last - gam))^T Vnew

Decode: one token per row
-------------------------
grid = (H // HB "parallel", S "arbitrary"); ``pool[src[s], heads]`` streams in through the
pipeline (a data-dependent index map), the new state goes out by DMA to ``dst[s]`` and to
every checkpoint slot whose offset is 1. q, k and the gate come as columns ``[Dk, HB]`` so
the per-channel decay scales the state's rows with a lane broadcast.

Assumptions: as for the GDN kernels (block shapes equal to the array's last two dims; a slot
written in a launch is not another row's source in it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common.chunking import (
    chunk_token_index,
    gather_chunks,
    max_chunks,
    plan_chunks,
    scatter_tokens,
)
from pallas_kernels.common.slots import StateSlots
from pallas_kernels.kda.reference import check_kda_args

CHUNK = 16
_HIGHEST = jax.lax.Precision.HIGHEST


def _mm(x, y, contract=((1,), (0,))):
    return jax.lax.dot_general(
        x, y, (contract, ((), ())), precision=_HIGHEST, preferred_element_type=jnp.float32
    )


def _softplus(x):
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def _l2norm(x, axis):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=axis, keepdims=True) + 1e-6)


def _heads_per_block(h: int, requested: int | None) -> int:
    hb = h if requested is None else requested
    if h % hb:
        raise ValueError(f"heads_per_block={hb} must divide {h=}")
    return hb


def _unit_lower_inverse(a, ii, jj):
    """``(I + a)^-1`` for strictly lower ``a``: recursive 2x2 block inversion (gdn/tpu.py)."""
    n = a.shape[0]
    x = (ii == jj).astype(jnp.float32)
    s, shift = 1, 0
    while s < n:
        same_pair = jnp.right_shift(ii, shift + 1) == jnp.right_shift(jj, shift + 1)
        other_half = jnp.right_shift(ii, shift) != jnp.right_shift(jj, shift)
        c = jnp.where(same_pair & other_half, a, 0.0)
        x = x - _mm(x, _mm(c, x))
        s, shift = 2 * s, shift + 1
    return x


def _chunk_step(q, k, v, g, beta, state):
    """One chunk of one head: q, k, g [C, Dk] (g masked, <= 0); v [C, Dv]; beta [C, 1]."""
    n = q.shape[0]
    ii = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    jj = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    gam = _mm((ii >= jj).astype(jnp.float32), g)  # [C, Dk] inclusive cumsum
    gam_last = jnp.sum(g, axis=0, keepdims=True)  # [1, Dk]
    row = jax.lax.broadcasted_iota(jnp.int32, (n, 1), 0)
    a_kk = jnp.zeros((n, n), jnp.float32)
    a_qk = jnp.zeros((n, n), jnp.float32)
    for j in range(n):  # column j: rows i >= j see exp(gam_i - gam_j) <= 1
        e_j = jnp.exp(jnp.where(row >= j, gam - gam[j : j + 1, :], -1e30))  # [C, Dk]
        kj = k[j : j + 1, :] * e_j
        a_kk = jnp.where(jj == j, jnp.sum(k * kj, axis=1, keepdims=True), a_kk)
        a_qk = jnp.where(jj == j, jnp.sum(q * kj, axis=1, keepdims=True), a_qk)
    a_kk = jnp.where(ii > jj, beta * a_kk, 0.0)
    tm = _unit_lower_inverse(a_kk, ii, jj)
    eg = jnp.exp(gam)
    w = _mm(tm, k * eg * beta)  # [C, Dk]
    u = _mm(tm, v * beta)  # [C, Dv]
    vnew = u - _mm(w, state)
    o = _mm(q * eg, state) + _mm(a_qk, vnew)
    k_dec = k * jnp.exp(gam_last - gam)
    state = state * _row_to_col(jnp.exp(gam_last)) + _mm(k_dec, vnew, ((0,), (0,)))
    return o, state


def _row_to_col(x):
    """``[1, n] -> [n, 1]`` with a masked lane reduction (no vector transpose needed)."""
    n = x.shape[1]
    ii = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    jj = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    return jnp.sum(jnp.where(ii == jj, jnp.broadcast_to(x, (n, n)), 0.0), axis=1, keepdims=True)


def _sync_copy(src_ref, dst_ref, sem, when=None):
    """A DMA started and waited in the same grid step (optionally under a condition)."""

    def copy():
        cp = pltpu.make_async_copy(src_ref, dst_ref, sem)
        cp.start()
        cp.wait()

    if when is None:
        copy()
    else:
        pl.when(when)(copy)


# ----------------------------------------------------------------------------- prefill


def _prefill_kernel(
    # scalar prefetch (SMEM)
    c_seq, c_len, c_end, c_first, c_last, n_chunks, src, dst, ck_off, ck_slot,
    # inputs
    neg_a_ref,  # SMEM f32[H]: -exp(A_log)
    q_ref, k_ref, g_ref,  # [HB, 1, C, Dk]  (g: raw gate + dt_bias)
    v_ref,  # [HB, 1, C, Dv]
    b_ref,  # [HB, 1, C, 1]
    pool_in,  # ANY f32[num_slots, H, Dk, Dv]
    # outputs
    o_ref,  # [HB, 1, C, Dv]
    pool_out,  # ANY, aliased to pool_in
    # scratch
    s_scr,  # VMEM f32[HB, Dk, Dv]
    sem,
    *, max_ckpt: int, scale: float,
):  # fmt: skip
    hb_idx, c = pl.program_id(0), pl.program_id(1)
    num_heads_blk = s_scr.shape[0]
    chunk = q_ref.shape[2]
    h0 = hb_idx * num_heads_blk
    heads = pl.ds(h0, num_heads_blk)
    live = c < n_chunks[0]
    seq = c_seq[c]

    @pl.when(live & (c_first[c] == 1))
    def _load_initial_state():
        slot = src[seq]

        @pl.when(slot > 0)
        def _():
            _sync_copy(pool_in.at[slot, heads], s_scr, sem)

        @pl.when(slot == 0)
        def _():
            s_scr[...] = jnp.zeros_like(s_scr)

    @pl.when(live)
    def _compute():
        rows_ok = jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0) >= chunk - c_len[c]

        def head(jh, carry):
            q = _l2norm(q_ref[jh, 0].astype(jnp.float32), axis=1) * scale
            k = _l2norm(k_ref[jh, 0].astype(jnp.float32), axis=1)
            v = v_ref[jh, 0].astype(jnp.float32)
            g = neg_a_ref[h0 + jh] * _softplus(g_ref[jh, 0].astype(jnp.float32))
            g = jnp.where(rows_ok, g, 0.0)
            beta = jnp.where(rows_ok, jax.nn.sigmoid(b_ref[jh, 0].astype(jnp.float32)), 0.0)
            o, s_new = _chunk_step(q, k, v, g, beta, s_scr[jh])
            s_scr[jh] = s_new
            o_ref[jh, 0] = o.astype(o_ref.dtype)
            return carry

        jax.lax.fori_loop(0, num_heads_blk, head, 0)

    @pl.when(live)
    def _write_states():
        for m in range(max_ckpt):
            slot = ck_slot[seq * max_ckpt + m]
            hit = (slot > 0) & (ck_off[seq * max_ckpt + m] == c_end[c])
            _sync_copy(s_scr, pool_out.at[slot, heads], sem, when=hit)
        slot = dst[seq]
        _sync_copy(s_scr, pool_out.at[slot, heads], sem, when=(c_last[c] == 1) & (slot > 0))


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
    heads_per_block: int | None = None,
    interpret=False,
) -> tuple[jax.Array, jax.Array]:
    """Chunked ragged prefill; see the module docstring. Returns ``(o [T, H, Dv], state)``."""
    check_kda_args(q, k, v, g, b, A_log, dt_bias, state, slots, query_start_loc)
    n, h, dk = q.shape
    dv = v.shape[2]
    hb = _heads_per_block(h, heads_per_block)
    rows, max_ckpt = slots.ckpt_offsets.shape
    plan = plan_chunks(query_start_loc, slots, num_tokens=n, chunk=CHUNK)
    nc = max_chunks(n, rows, max_ckpt, CHUNK)
    idx = chunk_token_index(plan, CHUNK, n)  # [NC, C]

    def heads_major(x):  # [T, H, D] -> [H, NC, C, D]
        return jnp.moveaxis(gather_chunks(x, idx), 2, 0)

    g_shift = g.astype(jnp.float32) + dt_bias.astype(jnp.float32)  # fuses into the gather
    qc, kc, gc, vc = heads_major(q), heads_major(k), heads_major(g_shift), heads_major(v)
    bc = heads_major(b[..., None])  # [H, NC, C, 1]

    def block_map(hh, c, cs, cl, ce, cf, cla, nch, *_):
        return (hh, jnp.minimum(c, jnp.maximum(nch[0] - 1, 0)), 0, 0)  # empty chunks: no DMA

    src, dst, ck_off, ck_slot, _ = slots.flat()
    prefetch = (
        plan.seq, plan.length, plan.end, plan.first, plan.last, plan.num_chunks,
        src, dst, ck_off, ck_slot,
    )  # fmt: skip
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch),
        grid=(h // hb, nc),
        in_specs=[
            pl.BlockSpec(memory_space=pltpu.SMEM),
            pl.BlockSpec((hb, 1, CHUNK, dk), block_map),
            pl.BlockSpec((hb, 1, CHUNK, dk), block_map),
            pl.BlockSpec((hb, 1, CHUNK, dk), block_map),
            pl.BlockSpec((hb, 1, CHUNK, dv), block_map),
            pl.BlockSpec((hb, 1, CHUNK, 1), block_map),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=[
            pl.BlockSpec((hb, 1, CHUNK, dv), block_map),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        scratch_shapes=[pltpu.VMEM((hb, dk, dv), jnp.float32), pltpu.SemaphoreType.DMA(())],
    )
    oc, state = pl.pallas_call(
        functools.partial(_prefill_kernel, max_ckpt=max_ckpt, scale=float(dk) ** -0.5),
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((h, nc, CHUNK, dv), v.dtype),
            jax.ShapeDtypeStruct(state.shape, state.dtype),
        ],
        input_output_aliases={len(prefetch) + 6: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="kda_prefill",
    )(*prefetch, -jnp.exp(A_log.astype(jnp.float32)), qc, kc, gc, vc, bc, state)
    return scatter_tokens(jnp.moveaxis(oc, 0, 2), plan), state  # [T, H, Dv]


# ----------------------------------------------------------------------------- decode


def _decode_kernel(
    # scalar prefetch
    src, dst, ck_off, ck_slot, n_seqs,
    # inputs
    neg_a_ref,  # SMEM f32[H]
    q_ref, k_ref, g_ref,  # [1, 1, Dk, HB]  columns (g: raw gate + dt_bias)
    v_ref,  # [1, 1, HB, Dv]
    b_ref,  # [1, 1, 1, HB]
    s_in,  # [1, HB, Dk, Dv]  pool[src[r], heads], pipelined
    # outputs
    o_ref,  # [1, 1, HB, Dv]
    pool_out,  # ANY, aliased to the pool that s_in is read from
    # scratch
    s_scr,  # VMEM f32[HB, Dk, Dv]
    sem,
    *, max_ckpt: int, scale: float,
):  # fmt: skip
    hb_idx, r = pl.program_id(0), pl.program_id(1)
    num_heads_blk = s_scr.shape[0]
    h0 = hb_idx * num_heads_blk
    heads = pl.ds(h0, num_heads_blk)
    live = r < n_seqs[0]
    has_src = src[r] > 0

    @pl.when(live)
    def _compute():
        for j in range(num_heads_blk):
            qc = _l2norm(q_ref[0, 0, :, j : j + 1].astype(jnp.float32), axis=0) * scale
            kc = _l2norm(k_ref[0, 0, :, j : j + 1].astype(jnp.float32), axis=0)  # [Dk, 1]
            gc = neg_a_ref[h0 + j] * _softplus(g_ref[0, 0, :, j : j + 1].astype(jnp.float32))
            b = b_ref[0, 0, :, j : j + 1].astype(jnp.float32)  # [1, 1]
            v = v_ref[0, 0, j : j + 1, :].astype(jnp.float32)  # [1, Dv]
            s = jnp.where(has_src, s_in[0, j], 0.0) * jnp.exp(gc)  # rows scaled per channel
            pred = jnp.sum(s * kc, axis=0, keepdims=True)  # [1, Dv] = S^T k
            s = s + kc * (jax.nn.sigmoid(b) * (v - pred))
            o_ref[0, 0, j : j + 1, :] = jnp.sum(s * qc, axis=0, keepdims=True).astype(o_ref.dtype)
            s_scr[j] = s

        for m in range(max_ckpt):
            slot = ck_slot[r * max_ckpt + m]
            hit = (slot > 0) & (ck_off[r * max_ckpt + m] == 1)
            _sync_copy(s_scr, pool_out.at[slot, heads], sem, when=hit)
        _sync_copy(s_scr, pool_out.at[dst[r], heads], sem, when=dst[r] > 0)

    @pl.when(~live)
    def _padding_row():
        o_ref[...] = jnp.zeros_like(o_ref)


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
    heads_per_block: int | None = None,
    interpret=False,
) -> tuple[jax.Array, jax.Array]:
    """One token per row. Returns ``(o [S, H, Dv], state)``; see the module docstring."""
    check_kda_args(q, k, v, g, b, A_log, dt_bias, state, slots)
    rows, h, dk = q.shape
    dv = v.shape[2]
    max_ckpt = slots.ckpt_offsets.shape[1]
    if rows != slots.num_rows:
        raise ValueError(f"decode rows {rows} must equal {slots.num_rows=} (one token each)")
    hb = _heads_per_block(
        h, heads_per_block or max(d for d in range(1, min(h, 8) + 1) if h % d == 0)
    )
    nhb = h // hb

    def columns(x):  # [S, H, Dk] -> [S, NHB, Dk, HB]
        return jnp.swapaxes(x.reshape(rows, nhb, hb, dk), 2, 3)

    g_shift = g.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    qc, kc, gc = columns(q), columns(k), columns(g_shift)
    vb = v.reshape(rows, nhb, hb, dv)
    bb = b.reshape(rows, nhb, 1, hb)

    def row_map(hh, r, *_):
        return (r, hh, 0, 0)

    def state_map(hh, r, src, dst, ck_off, ck_slot, n):
        return (jnp.where(r < n[0], src[r], 0), hh, 0, 0)  # src 0 / padding: never used

    prefetch = slots.flat()
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch),
        grid=(nhb, rows),
        in_specs=[
            pl.BlockSpec(memory_space=pltpu.SMEM),
            pl.BlockSpec((1, 1, dk, hb), row_map),
            pl.BlockSpec((1, 1, dk, hb), row_map),
            pl.BlockSpec((1, 1, dk, hb), row_map),
            pl.BlockSpec((1, 1, hb, dv), row_map),
            pl.BlockSpec((1, 1, 1, hb), row_map),
            pl.BlockSpec((1, hb, dk, dv), state_map),
        ],
        out_specs=[
            pl.BlockSpec((1, 1, hb, dv), row_map),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        scratch_shapes=[pltpu.VMEM((hb, dk, dv), jnp.float32), pltpu.SemaphoreType.DMA(())],
    )
    o, state = pl.pallas_call(
        functools.partial(_decode_kernel, max_ckpt=max_ckpt, scale=float(dk) ** -0.5),
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((rows, nhb, hb, dv), v.dtype),
            jax.ShapeDtypeStruct(state.shape, state.dtype),
        ],
        input_output_aliases={len(prefetch) + 6: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="kda_decode",
    )(*prefetch, -jnp.exp(A_log.astype(jnp.float32)), qc, kc, gc, vb, bb, state)
    return o.reshape(rows, h, dv), state
