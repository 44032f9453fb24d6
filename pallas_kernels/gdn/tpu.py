"""Gated delta rule Pallas kernels for TPU (Mosaic), with explicit state slots (DESIGN.md §3).

Same signatures and semantics as :mod:`pallas_kernels.gdn.reference`; ``interpret`` is passed
to ``pallas_call`` (``pltpu.InterpretParams()`` runs the kernels on CPU, which is how CI tests
them).

Prefill: the chunked (WY/UT) form, 64-token chunks
--------------------------------------------------
The wrapper cuts the ragged batch into chunks (:mod:`pallas_kernels.common.chunking`: a chunk
never straddles a sequence or a checkpoint offset) and gathers each chunk into a right-aligned
block of 64 rows, head-major, so every kernel block is a plain ``(64, D)`` tile::

    q, k [T, Hk, Dk] --gather--> [Hk, NC, 64, Dk]      a, b [T, Hv] --> [Hv, NC, 1, 64]
    v    [T, Hv, Dv] --gather--> [Hv, NC, 64, Dv]      o [Hv, NC, 64, Dv] --scatter--> [T, Hv, Dv]

    grid = (Hv // HB "parallel", NC "arbitrary")     state of HB heads: VMEM scratch f32

    chunk c of sequence s:   first[c]?  state <- pool[src[s]]  (DMA; zeros when src == 0)
                             state, o   <- chunk step (below), per value head of the block
                             end[c] == ckpt_offsets[s, m]?  pool[ckpt_slots[s, m]] <- state
                             last[c]?   pool[dst[s]] <- state  (slot 0: nothing written)

The chunk step per value head (key head ``h // (Hv // Hk)``), with the padded rows at the top
of the block zeroed (``g = beta = 0``, ``q = k = v = 0``: they contribute nothing, and the
chunk's total decay is the decay up to its last valid row)::

    q, k   = l2norm(q) * Dk**-0.5, l2norm(k)        g = -exp(A_log) softplus(a + dt_bias)
    gam    = cumsum(g)                               beta = sigmoid(b)
    A      = strict_lower(beta_i (k_i . k_j) exp(gam_i - gam_j))
    Tm     = (I + A)^-1                              recursive 2x2 block inversion, 12 matmuls
    W, U   = Tm (beta exp(gam) k), Tm (beta v)
    Vnew   = U - W S
    o      = (q exp(gam)) S + incl_lower((q k^T) exp(gam_i - gam_j)) Vnew
    S      = exp(gam_last) S + (k exp(gam_last - gam))^T Vnew

Empty chunks (capacity padding) map their blocks to the last real chunk, so they cost one grid
step and no DMA.

Decode: one token per row, one pass over the state
--------------------------------------------------
grid = (Hv // HB "parallel", S "arbitrary"); the state block ``pool[src[s], heads]`` comes in
through the pipeline (a data-dependent index map over scalar-prefetched slots, so the next
row's state streams in while this row computes); the new state goes out by DMA to ``dst[s]``
and to every checkpoint slot whose offset is 1. All math is on the VPU: with q, k as columns
(the wrapper transposes them; they are 1/Dv of the traffic) ``S^T k`` is a sublane reduction
and the rank-1 update a broadcast product.

Assumptions (what Mosaic accepts, and what the scheduler guarantees)
--------------------------------------------------------------------
- Block shapes: every block's last two dims equal the array's (``(64, Dk)``, ``(1, 64)``,
  ``(Dk, HB)``, ``(HB, Dv)``), so any head dims work; ``Dk, Dv`` multiples of 128 give
  unpadded tiles. f32 matmuls run at ``Precision.HIGHEST``.
- The prefill keeps ``HB * Dk * Dv * 4`` bytes of state in VMEM (default ``HB = Hv``: 2 MiB at
  Qwen3-Next-80B shapes) plus double-buffered q/k/v/o blocks (~1.5 MiB).
- Slot hazards: a slot written in a launch (dst or checkpoint) is not the source of another
  row of the same launch (DESIGN.md §4, same-step rule). A row may read and write the same
  slot. All DMAs are waited inside their grid step.
- The chunk gather/scatter costs one extra pass over q, k, v and o in XLA; a ragged DMA
  straight from ``[T, H, D]`` would remove it.
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
from pallas_kernels.gdn.reference import check_gdn_args

CHUNK = 64
_HIGHEST = jax.lax.Precision.HIGHEST


# ----------------------------------------------------------------------------- checks


def _heads_per_block(hv: int, ratio: int, requested: int | None) -> int:
    hb = hv if requested is None else requested
    if hv % hb or hb % ratio:
        raise ValueError(
            f"heads_per_block={hb} must divide {hv=} and be a multiple of the GVA ratio {ratio}"
        )
    return hb


# ----------------------------------------------------------------------------- in-kernel math


def _mm(x, y, contract=((1,), (0,))):
    return jax.lax.dot_general(
        x, y, (contract, ((), ())), precision=_HIGHEST, preferred_element_type=jnp.float32
    )


def _softplus(x):
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def _l2norm(x, axis):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=axis, keepdims=True) + 1e-6)


def _iotas(n):
    return (
        jax.lax.broadcasted_iota(jnp.int32, (n, n), 0),
        jax.lax.broadcasted_iota(jnp.int32, (n, n), 1),
    )


def _row_to_col(x):
    """``[1, n] -> [n, 1]`` with a masked lane reduction (no vector transpose needed)."""
    n = x.shape[1]
    i, j = _iotas(n)
    return jnp.sum(jnp.where(i == j, jnp.broadcast_to(x, (n, n)), 0.0), axis=1, keepdims=True)


def _unit_lower_inverse(a):
    """``(I + a)^-1`` for strictly lower-triangular ``a [n, n]`` (n a power of two).

    Recursive 2x2 block inversion, all levels at once: with ``x`` the block-diagonal inverse
    for blocks of size ``s``, the inverse for blocks of ``2s`` is ``x - x c x`` where ``c``
    keeps the entries of ``a`` below the diagonal blocks inside each ``2s`` block::

        [D1  0 ]^-1   [ D1^-1              0    ]
        [C   D2]    = [ -D2^-1 C D1^-1     D2^-1]

    Products of true sub-inverses only (unlike a Neumann series, nothing grows beyond the
    inverse itself).
    """
    n = a.shape[0]
    i, j = _iotas(n)
    x = (i == j).astype(jnp.float32)
    s, shift = 1, 0
    while s < n:
        same_pair = jnp.right_shift(i, shift + 1) == jnp.right_shift(j, shift + 1)
        other_half = jnp.right_shift(i, shift) != jnp.right_shift(j, shift)
        c = jnp.where(same_pair & other_half, a, 0.0)
        x = x - _mm(x, _mm(c, x))
        s, shift = 2 * s, shift + 1
    return x


def _chunk_step(q, k, v, g, beta, state):
    """One chunk of one head. q, k [C, Dk]; v [C, Dv]; g, beta [1, C]; state [Dk, Dv].

    Inputs are already normalised/scaled and masked; returns ``(o [C, Dv], state)``.
    """
    n = q.shape[0]
    i, j = _iotas(n)
    g_all = jnp.broadcast_to(g, (n, n))  # [i, j] = g_j
    gam_col = jnp.sum(jnp.where(j <= i, g_all, 0.0), axis=1, keepdims=True)  # [C, 1]
    g_col = _row_to_col(g)
    gam_row = jnp.sum(  # [1, C]
        jnp.where(i <= j, jnp.broadcast_to(g_col, (n, n)), 0.0), axis=0, keepdims=True
    )
    gam_last = jnp.sum(g, axis=1, keepdims=True)  # [1, 1]: padded rows have g = 0
    beta_col = _row_to_col(beta)
    # exp(gam_i - gam_j) on and below the diagonal, 0 above (selected, never inf * 0).
    decay = jnp.exp(jnp.where(i >= j, gam_col - gam_row, -1e30))  # [C, C]
    a_mat = jnp.where(i > j, beta_col * _mm(k, k, ((1,), (1,))) * decay, 0.0)
    tm = _unit_lower_inverse(a_mat)
    eg = jnp.exp(gam_col)  # [C, 1]
    w = _mm(tm, k * (beta_col * eg))  # [C, Dk]
    u = _mm(tm, v * beta_col)  # [C, Dv]
    vnew = u - _mm(w, state)
    qk = _mm(q, k, ((1,), (1,))) * decay  # zero above the diagonal
    o = _mm(q * eg, state) + _mm(qk, vnew)
    k_dec = k * jnp.exp(gam_last - gam_col)  # [C, Dk]
    state = state * jnp.exp(gam_last) + _mm(k_dec, vnew, ((0,), (0,)))
    return o, state


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
    gates_ref,  # SMEM f32[2 * Hv]: -exp(A_log) | dt_bias
    q_ref, k_ref,  # [HKB, 1, C, Dk]
    v_ref,  # [HB, 1, C, Dv]
    a_ref, b_ref,  # [HB, 1, 1, C]
    pool_in,  # ANY f32[num_slots, Hv, Dk, Dv]
    # outputs
    o_ref,  # [HB, 1, C, Dv]
    pool_out,  # ANY, aliased to pool_in
    # scratch
    s_scr,  # VMEM f32[HB, Dk, Dv]
    sem,
    *, ratio: int, max_ckpt: int, scale: float,
):  # fmt: skip
    hb_idx, c = pl.program_id(0), pl.program_id(1)
    num_heads_blk = s_scr.shape[0]
    chunk = q_ref.shape[2]
    hv = gates_ref.shape[0] // 2
    h0 = hb_idx * num_heads_blk
    heads = pl.ds(h0, num_heads_blk)
    live = c < n_chunks[0]
    seq = c_seq[c]
    length = c_len[c]

    def copy(src_ref, dst_ref):
        _sync_copy(src_ref, dst_ref, sem)

    @pl.when(live & (c_first[c] == 1))
    def _load_initial_state():
        slot = src[seq]

        @pl.when(slot > 0)
        def _():
            copy(pool_in.at[slot, heads], s_scr)

        @pl.when(slot == 0)
        def _():
            s_scr[...] = jnp.zeros_like(s_scr)

    @pl.when(live)
    def _compute():
        row_ok = jax.lax.broadcasted_iota(jnp.int32, (1, chunk), 1) >= chunk - length  # [1, C]

        def head(jh, carry):
            h = h0 + jh
            jk = jh // ratio
            q = _l2norm(q_ref[jk, 0].astype(jnp.float32), axis=1) * scale
            k = _l2norm(k_ref[jk, 0].astype(jnp.float32), axis=1)
            v = v_ref[jh, 0].astype(jnp.float32)
            a = a_ref[jh, 0].astype(jnp.float32)
            b = b_ref[jh, 0].astype(jnp.float32)
            g = jnp.where(row_ok, gates_ref[h] * _softplus(a + gates_ref[hv + h]), 0.0)
            beta = jnp.where(row_ok, jax.nn.sigmoid(b), 0.0)
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


def gdn_prefill(
    q: jax.Array,  # [T, Hk, Dk]  post-conv, before l2norm
    k: jax.Array,  # [T, Hk, Dk]
    v: jax.Array,  # [T, Hv, Dv]
    a: jax.Array,  # [T, Hv]
    b: jax.Array,  # [T, Hv]
    A_log: jax.Array,  # f32[Hv]
    dt_bias: jax.Array,  # f32[Hv]
    state: jax.Array,  # f32[num_slots, Hv, Dk, Dv]  donated: updated in place
    query_start_loc: jax.Array,  # i32[S+1]
    slots: StateSlots,  # DESIGN.md §3
    *,
    heads_per_block: int | None = None,
    interpret=False,
) -> tuple[jax.Array, jax.Array]:
    """Chunked ragged prefill; see the module docstring. Returns ``(o [T, Hv, Dv], state)``.

    Writes ``state[dst_slot[s]]`` (final state) and ``state[ckpt_slots[s, m]]`` (state after
    ``ckpt_offsets[s, m]`` tokens) for live rows; every other slot is left untouched.
    """
    check_gdn_args(q, k, v, a, b, A_log, dt_bias, state, slots, query_start_loc)
    n, hk, dk = q.shape
    _, hv, dv = v.shape
    ratio = hv // hk
    hb = _heads_per_block(hv, ratio, heads_per_block)
    rows, max_ckpt = slots.ckpt_offsets.shape
    plan = plan_chunks(query_start_loc, slots, num_tokens=n, chunk=CHUNK)
    nc = max_chunks(n, rows, max_ckpt, CHUNK)
    idx = chunk_token_index(plan, CHUNK, n)  # [NC, C]

    # [T, H, D] -> [H, NC, C, D] (right-aligned chunks); gates [T, Hv] -> [Hv, NC, 1, C].
    def heads_major(x):
        return jnp.moveaxis(gather_chunks(x, idx), 2, 0)

    qc, kc, vc = heads_major(q), heads_major(k), heads_major(v)
    ac = jnp.moveaxis(gather_chunks(a, idx), 2, 0)[:, :, None, :]
    bc = jnp.moveaxis(gather_chunks(b, idx), 2, 0)[:, :, None, :]
    gates = jnp.concatenate(
        [-jnp.exp(A_log.astype(jnp.float32)), dt_bias.astype(jnp.float32)]
    )  # f32[2 Hv]

    def chunk_of(c, n_chunks):
        return jnp.minimum(c, jnp.maximum(n_chunks[0] - 1, 0))  # empty chunks: no new DMA

    def qk_map(h, c, cs, cl, ce, cf, cla, nch, *_):
        return (h, chunk_of(c, nch), 0, 0)

    src, dst, ck_off, ck_slot, _ = slots.flat()
    prefetch = (
        plan.seq, plan.length, plan.end, plan.first, plan.last, plan.num_chunks,
        src, dst, ck_off, ck_slot,
    )  # fmt: skip
    kernel = functools.partial(
        _prefill_kernel, ratio=ratio, max_ckpt=max_ckpt, scale=float(dk) ** -0.5
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch),
        grid=(hv // hb, nc),
        in_specs=[
            pl.BlockSpec(memory_space=pltpu.SMEM),
            pl.BlockSpec((hb // ratio, 1, CHUNK, dk), qk_map),
            pl.BlockSpec((hb // ratio, 1, CHUNK, dk), qk_map),
            pl.BlockSpec((hb, 1, CHUNK, dv), qk_map),
            pl.BlockSpec((hb, 1, 1, CHUNK), qk_map),
            pl.BlockSpec((hb, 1, 1, CHUNK), qk_map),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=[
            pl.BlockSpec((hb, 1, CHUNK, dv), qk_map),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        scratch_shapes=[pltpu.VMEM((hb, dk, dv), jnp.float32), pltpu.SemaphoreType.DMA(())],
    )
    oc, state = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((hv, nc, CHUNK, dv), v.dtype),
            jax.ShapeDtypeStruct(state.shape, state.dtype),
        ],
        input_output_aliases={len(prefetch) + 6: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="gdn_prefill",
    )(*prefetch, gates, qc, kc, vc, ac, bc, state)
    o = scatter_tokens(jnp.moveaxis(oc, 0, 2), plan)  # [T, Hv, Dv]
    return o, state


# ----------------------------------------------------------------------------- decode


def _decode_kernel(
    # scalar prefetch
    src, dst, ck_off, ck_slot, n_seqs,
    # inputs
    gates_ref,  # SMEM f32[2 * Hv]
    q_ref, k_ref,  # [1, 1, Dk, HB]  columns
    v_ref,  # [1, 1, HB, Dv]
    a_ref, b_ref,  # [1, 1, 1, HB]
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
    hv = gates_ref.shape[0] // 2
    h0 = hb_idx * num_heads_blk
    heads = pl.ds(h0, num_heads_blk)
    live = r < n_seqs[0]
    has_src = src[r] > 0

    @pl.when(live)
    def _compute():
        for j in range(num_heads_blk):
            h = h0 + j
            qc = _l2norm(q_ref[0, 0, :, j : j + 1].astype(jnp.float32), axis=0) * scale
            kc = _l2norm(k_ref[0, 0, :, j : j + 1].astype(jnp.float32), axis=0)  # [Dk, 1]
            a = a_ref[0, 0, :, j : j + 1].astype(jnp.float32)  # [1, 1]
            b = b_ref[0, 0, :, j : j + 1].astype(jnp.float32)
            v = v_ref[0, 0, j : j + 1, :].astype(jnp.float32)  # [1, Dv]
            g = gates_ref[h] * _softplus(a + gates_ref[hv + h])
            s = jnp.where(has_src, s_in[0, j], 0.0) * jnp.exp(g)  # [Dk, Dv]
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


def gdn_decode(
    q: jax.Array,  # [S, Hk, Dk]
    k: jax.Array,  # [S, Hk, Dk]
    v: jax.Array,  # [S, Hv, Dv]
    a: jax.Array,  # [S, Hv]
    b: jax.Array,  # [S, Hv]
    A_log: jax.Array,  # f32[Hv]
    dt_bias: jax.Array,  # f32[Hv]
    state: jax.Array,  # f32[num_slots, Hv, Dk, Dv]  donated: updated in place
    slots: StateSlots,  # DESIGN.md §3
    *,
    heads_per_block: int | None = None,
    interpret=False,
) -> tuple[jax.Array, jax.Array]:
    """One token per row. Returns ``(o [S, Hv, Dv], state)``; see the module docstring.

    Writes ``state[dst_slot[s]]`` and ``state[ckpt_slots[s, m]]`` where
    ``ckpt_offsets[s, m] == 1`` for live rows.
    """
    check_gdn_args(q, k, v, a, b, A_log, dt_bias, state, slots)
    rows, hk, dk = q.shape
    _, hv, dv = v.shape
    max_ckpt = slots.ckpt_offsets.shape[1]
    if rows != slots.num_rows:
        raise ValueError(f"decode rows {rows} must equal {slots.num_rows=} (one token each)")
    hb = _heads_per_block(hv, 1, heads_per_block or _divisor_at_most(hv, 8))
    nhb = hv // hb

    # Value-head-major columns: [S, Hk, Dk] -> [S, NHB, Dk, HB].
    def columns(x):
        x = jnp.repeat(x, hv // hk, axis=1).reshape(rows, nhb, hb, dk)
        return jnp.swapaxes(x, 2, 3)

    qc, kc = columns(q), columns(k)
    vb = v.reshape(rows, nhb, hb, dv)
    ab = a.reshape(rows, nhb, 1, hb)
    bb = b.reshape(rows, nhb, 1, hb)
    gates = jnp.concatenate([-jnp.exp(A_log.astype(jnp.float32)), dt_bias.astype(jnp.float32)])

    def row_map(h, r, *_):
        return (r, h, 0, 0)

    def state_map(h, r, src, dst, ck_off, ck_slot, n):
        # Padding rows and src 0 fetch slot 0 (never used): consecutive repeats are not refetched.
        return (jnp.where(r < n[0], src[r], 0), h, 0, 0)

    prefetch = slots.flat()
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch),
        grid=(nhb, rows),
        in_specs=[
            pl.BlockSpec(memory_space=pltpu.SMEM),
            pl.BlockSpec((1, 1, dk, hb), row_map),
            pl.BlockSpec((1, 1, dk, hb), row_map),
            pl.BlockSpec((1, 1, hb, dv), row_map),
            pl.BlockSpec((1, 1, 1, hb), row_map),
            pl.BlockSpec((1, 1, 1, hb), row_map),
            pl.BlockSpec((1, hb, dk, dv), state_map),
        ],
        out_specs=[
            pl.BlockSpec((1, 1, hb, dv), row_map),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        scratch_shapes=[pltpu.VMEM((hb, dk, dv), jnp.float32), pltpu.SemaphoreType.DMA(())],
    )
    kernel = functools.partial(_decode_kernel, max_ckpt=max_ckpt, scale=float(dk) ** -0.5)
    o, state = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((rows, nhb, hb, dv), v.dtype),
            jax.ShapeDtypeStruct(state.shape, state.dtype),
        ],
        input_output_aliases={len(prefetch) + 6: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="gdn_decode",
    )(*prefetch, gates, qc, kc, vb, ab, bb, state)
    return o.reshape(rows, hv, dv), state


def _divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)
