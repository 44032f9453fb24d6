"""KDA Pallas kernels for TPU (Mosaic), with explicit state slots (DESIGN.md §3).

Same signatures and semantics as :mod:`pallas_kernels.kda.reference`; ``interpret`` is
passed to ``pallas_call`` (``pltpu.InterpretParams()`` runs them on CPU: how CI tests them).
The grids, the slot loads and stores and the block layout are those of
:mod:`pallas_kernels.common.delta_rule_tpu` (shared with :mod:`pallas_kernels.gdn.tpu`); the
chunk step is :mod:`pallas_kernels.common.delta_rule`'s. What is KDA's: a gate per key channel
(its per-channel decay sits inside the intra-chunk dot products), 16-token chunks, one key head
per value head.

Prefill: 16-token chunks, right-aligned blocks, the state in VMEM
-----------------------------------------------------------------
``dt_bias`` is added to the raw gate in the gather that builds the blocks::

    q, k, g + dt_bias [T, H, Dk] --> [H, NC, 16, Dk]      b [T, H] --> [H, NC, 16, 1]
    v [T, H, Dv]                 --> [H, NC, 16, Dv]      o [H, NC, 16, Dv] --> [T, H, Dv]

The gate part of the chunk step keeps every ``exp`` argument <= 0: the pairwise decays
``exp(gam_i - gam_j)`` (i >= j) are built one column ``j`` at a time as ``[16, Dk]`` tiles
(2-D, VPU), which is what makes the decay inside the dot products exact and stable::

    gam        = cumsum(g)                         lower-ones matmul, [C, Dk]
    col j:     e_j = exp(gam - gam_j) (rows >= j) Akk[:, j] = beta (k e_j) k_j
                                                   Aqk[:, j] = (q e_j) k_j

then ``Tm = (I + Akk)^-1``, W, U, Vnew, o and ``S = diag(exp(gam_last)) S + ...``.

Decode: one token per row
-------------------------
q, k and the gate come as columns ``[Dk, HB]``, so the per-channel decay ``exp(g)`` scales the
state's rows with a lane broadcast.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common.chunking import (
    chunk_token_index,
    gather_chunks,
    max_chunks,
    plan_chunks,
    scatter_tokens,
)
from pallas_kernels.common.delta_rule import GatedChunk, delta_rule_chunk, l2norm, mm, softplus
from pallas_kernels.common.delta_rule_tpu import (
    DecodePrefetch,
    PrefillPrefetch,
    StateScratch,
    decode_grid_step,
    divisor_at_most,
    for_each_head,
    iotas,
    launch_decode,
    launch_prefill,
    prefill_grid_step,
    row_to_col,
)
from pallas_kernels.common.slots import StateSlots
from pallas_kernels.kda.reference import check_kda_args

CHUNK = 16


def _heads_per_block(h: int, requested: int | None) -> int:
    hb = h if requested is None else requested
    if h % hb:
        raise ValueError(f"heads_per_block={hb} must divide {h=}")
    return hb


def _gated_chunk(q, k, g, beta) -> GatedChunk:
    """The per-channel gate's operands: q, k, g [C, Dk] (g masked, <= 0); beta [C, 1]."""
    n = q.shape[0]
    ii, jj = iotas(n)
    gam = mm((ii >= jj).astype(jnp.float32), g)  # [C, Dk] inclusive cumsum
    gam_last = jnp.sum(g, axis=0, keepdims=True)  # [1, Dk]
    row = jax.lax.broadcasted_iota(jnp.int32, (n, 1), 0)
    a_kk = jnp.zeros((n, n), jnp.float32)
    a_qk = jnp.zeros((n, n), jnp.float32)
    for j in range(n):  # column j: rows i >= j see exp(gam_i - gam_j) <= 1
        e_j = jnp.exp(jnp.where(row >= j, gam - gam[j : j + 1, :], -1e30))  # [C, Dk]
        kj = k[j : j + 1, :] * e_j
        a_kk = jnp.where(jj == j, jnp.sum(k * kj, axis=1, keepdims=True), a_kk)
        a_qk = jnp.where(jj == j, jnp.sum(q * kj, axis=1, keepdims=True), a_qk)
    eg = jnp.exp(gam)
    return GatedChunk(
        a_kk=jnp.where(ii > jj, beta * a_kk, 0.0),
        a_qk=a_qk,
        q_dec=q * eg,
        kb_dec=k * eg * beta,
        k_dec=k * jnp.exp(gam_last - gam),
        s_decay=row_to_col(jnp.exp(gam_last)),  # [Dk, 1]: the state's rows, per channel
    )


# ----------------------------------------------------------------------------- prefill


def _prefill_kernel(
    p: PrefillPrefetch,  # SMEM: the chunk plan and the slots
    neg_a_ref,  # SMEM f32[H]: -exp(A_log)
    q_ref, k_ref, g_ref,  # [HB, 1, C, Dk]  (g: raw gate + dt_bias)
    v_ref,  # [HB, 1, C, Dv]
    b_ref,  # [HB, 1, C, 1]
    pool_in,  # ANY f32 | bf16[num_slots, H, Dv, Dk]
    o_ref,  # [HB, 1, C, Dv]
    pool_out,  # ANY, aliased to pool_in
    scr: StateScratch,  # VMEM f32 state of the head block, DMA semaphore, stage
    *, scale: float,
):  # fmt: skip
    chunk = q_ref.shape[2]

    def compute(h0, length):
        rows_ok = jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0) >= chunk - length

        def head(jh, state):
            q = l2norm(q_ref[jh, 0].astype(jnp.float32), axis=1) * scale
            k = l2norm(k_ref[jh, 0].astype(jnp.float32), axis=1)
            v = v_ref[jh, 0].astype(jnp.float32)
            g = neg_a_ref[h0 + jh] * softplus(g_ref[jh, 0].astype(jnp.float32))
            g = jnp.where(rows_ok, g, 0.0)
            beta = jnp.where(rows_ok, jax.nn.sigmoid(b_ref[jh, 0].astype(jnp.float32)), 0.0)
            return delta_rule_chunk(_gated_chunk(q, k, g, beta), v * beta, state)

        for_each_head(scr.state, o_ref, head)

    prefill_grid_step(p, pool_in, pool_out, scr, compute)


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

    oc, state = launch_prefill(
        _prefill_kernel,
        name="kda_prefill",
        plan=plan,
        slots=slots,
        smem=-jnp.exp(A_log.astype(jnp.float32)),
        blocks=(qc, kc, gc, vc, bc),
        state=state,
        out=jax.ShapeDtypeStruct((h, nc, CHUNK, dv), v.dtype),
        heads_per_block=hb,
        interpret=interpret,
        scale=float(dk) ** -0.5,
    )
    return scatter_tokens(jnp.moveaxis(oc, 0, 2), plan), state  # [T, H, Dv]


# ----------------------------------------------------------------------------- decode


def _decode_kernel(
    p: DecodePrefetch,  # SMEM: the slots
    neg_a_ref,  # SMEM f32[H]
    q_ref, k_ref, g_ref,  # [1, 1, Dk, HB]  columns (g: raw gate + dt_bias)
    v_ref,  # [1, 1, HB, Dv]
    b_ref,  # [1, 1, 1, HB]
    s_in,  # [1, HB, Dv, Dk]  pool[src[r], heads], pipelined
    o_ref,  # [1, 1, HB, Dv]
    pool_out,  # ANY, aliased to the pool that s_in is read from
    scr: StateScratch,  # VMEM f32 state of the head block, DMA semaphore, stage
    *, scale: float,
):  # fmt: skip
    def head(h, j):
        qc = l2norm(q_ref[0, 0, :, j : j + 1].astype(jnp.float32), axis=0) * scale
        kc = l2norm(k_ref[0, 0, :, j : j + 1].astype(jnp.float32), axis=0)  # [Dk, 1]
        gc = neg_a_ref[h] * softplus(g_ref[0, 0, :, j : j + 1].astype(jnp.float32))
        b = b_ref[0, 0, :, j : j + 1].astype(jnp.float32)  # [1, 1]
        v = v_ref[0, 0, j : j + 1, :].astype(jnp.float32)  # [1, Dv]
        return qc, kc, v, jax.nn.sigmoid(b), jnp.exp(gc)  # decay: the state's rows, per channel

    decode_grid_step(p, s_in, o_ref, pool_out, scr, head)


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
    heads_per_block: int | None = None,
    interpret=False,
) -> tuple[jax.Array, jax.Array]:
    """One token per row. Returns ``(o [S, H, Dv], state)``; see the module docstring."""
    check_kda_args(q, k, v, g, b, A_log, dt_bias, state, slots)
    rows, h, dk = q.shape
    dv = v.shape[2]
    if rows != slots.num_rows:
        raise ValueError(f"decode rows {rows} must equal {slots.num_rows=} (one token each)")
    hb = _heads_per_block(h, heads_per_block or divisor_at_most(h, 8))
    nhb = h // hb

    def columns(x):  # [S, H, Dk] -> [S, NHB, Dk, HB]
        return jnp.swapaxes(x.reshape(rows, nhb, hb, dk), 2, 3)

    g_shift = g.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    qc, kc, gc = columns(q), columns(k), columns(g_shift)
    vb = v.reshape(rows, nhb, hb, dv)
    bb = b.reshape(rows, nhb, 1, hb)

    o, state = launch_decode(
        _decode_kernel,
        name="kda_decode",
        slots=slots,
        smem=-jnp.exp(A_log.astype(jnp.float32)),
        blocks=(qc, kc, gc, vb, bb),
        state=state,
        out=jax.ShapeDtypeStruct((rows, nhb, hb, dv), v.dtype),
        interpret=interpret,
        scale=float(dk) ** -0.5,
    )
    return o.reshape(rows, h, dv), state
