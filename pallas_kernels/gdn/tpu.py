"""Gated delta rule Pallas kernels for TPU (Mosaic), with explicit state slots (DESIGN.md §3).

Same signatures and semantics as :mod:`pallas_kernels.gdn.reference`; ``interpret`` is passed
to ``pallas_call`` (``pltpu.InterpretParams()`` runs the kernels on CPU, which is how CI tests
them). The grids, the slot loads and stores and the block layout are those of
:mod:`pallas_kernels.common.delta_rule_tpu`; the chunk step is
:mod:`pallas_kernels.common.delta_rule`'s. What is GDN's: one gate per value head, 64-token
chunks, and GVA (``Hk`` key heads shared by ``Hv // Hk`` value heads).

Prefill: the chunked (WY/UT) form, 64-token chunks
--------------------------------------------------
Each chunk is gathered into a right-aligned block of 64 rows, head-major::

    q, k [T, Hk, Dk] --gather--> [Hk, NC, 64, Dk]      a, b [T, Hv] --> [Hv, NC, 1, 64]
    v    [T, Hv, Dv] --gather--> [Hv, NC, 64, Dv]      o [Hv, NC, 64, Dv] --scatter--> [T, Hv, Dv]

    grid = (Hv // HB, NC); a head block of HB value heads reads HB // (Hv // Hk) key heads

The gate part of the chunk step per value head (key head ``h // (Hv // Hk)``), with the
padded rows at the top of the block zeroed (``g = beta = 0``, ``q = k = v = 0``: the chunk's
total decay is the decay up to its last valid row)::

    q, k   = l2norm(q) * Dk**-0.5, l2norm(k)        g = -exp(A_log) softplus(a + dt_bias)
    gam    = cumsum(g)  ([C, 1] and [1, C]: masked lane and sublane sums, no transpose)
    decay  = exp(gam_i - gam_j) on and below the diagonal, 0 above      [C, C]
    A      = strict_lower(beta_i (k_i . k_j) decay)    Aqk = (q k^T) decay     (two matmuls)

then ``Tm = (I + A)^-1`` (12 matmuls at C = 64), W, U, Vnew, o and the state update.

Decode: one token per row, one pass over the state
--------------------------------------------------
The wrapper repeats q and k to the value heads and transposes them to columns ``[Dk, HB]``;
the decay ``exp(g)`` is one scalar per head.

Assumptions: those of :mod:`pallas_kernels.common.delta_rule_tpu` (block shapes equal to the
array's last two dims; a slot written in a launch is not another row's source in it). At
Qwen3-Next-80B shapes the prefill holds 2 MiB of state in VMEM (``HB = Hv``) plus ~1.5 MiB of
double-buffered q/k/v/o blocks.
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
from pallas_kernels.common.delta_rule import NT, GatedChunk, delta_rule_chunk, l2norm, mm, softplus
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
from pallas_kernels.gdn.reference import check_gdn_args

CHUNK = 64


def _heads_per_block(hv: int, ratio: int, requested: int | None) -> int:
    hb = hv if requested is None else requested
    if hv % hb or hb % ratio:
        raise ValueError(
            f"heads_per_block={hb} must divide {hv=} and be a multiple of the GVA ratio {ratio}"
        )
    return hb


def _gated_chunk(q, k, g, beta_col) -> GatedChunk:
    """The scalar gate's operands: q, k [C, Dk]; g [1, C] (masked, <= 0); beta_col [C, 1]."""
    n = q.shape[0]
    i, j = iotas(n)
    g_all = jnp.broadcast_to(g, (n, n))  # [i, j] = g_j
    gam_col = jnp.sum(jnp.where(j <= i, g_all, 0.0), axis=1, keepdims=True)  # [C, 1]
    g_col = row_to_col(g)
    gam_row = jnp.sum(  # [1, C]
        jnp.where(i <= j, jnp.broadcast_to(g_col, (n, n)), 0.0), axis=0, keepdims=True
    )
    gam_last = jnp.sum(g, axis=1, keepdims=True)  # [1, 1]: padded rows have g = 0
    # exp(gam_i - gam_j) on and below the diagonal, 0 above (selected, never inf * 0).
    decay = jnp.exp(jnp.where(i >= j, gam_col - gam_row, -1e30))  # [C, C]
    eg = jnp.exp(gam_col)  # [C, 1]
    return GatedChunk(
        a_kk=jnp.where(i > j, beta_col * mm(k, k, NT) * decay, 0.0),
        a_qk=mm(q, k, NT) * decay,  # zero above the diagonal
        q_dec=q * eg,
        kb_dec=k * (beta_col * eg),
        k_dec=k * jnp.exp(gam_last - gam_col),
        s_decay=jnp.exp(gam_last),
    )


# ----------------------------------------------------------------------------- prefill


def _prefill_kernel(
    p: PrefillPrefetch,  # SMEM: the chunk plan and the slots
    gates_ref,  # SMEM f32[2 * Hv]: -exp(A_log) | dt_bias
    q_ref, k_ref,  # [HKB, 1, C, Dk]
    v_ref,  # [HB, 1, C, Dv]
    a_ref, b_ref,  # [HB, 1, 1, C]
    pool_in,  # ANY f32 | bf16[num_slots, Hv, Dv, Dk]
    o_ref,  # [HB, 1, C, Dv]
    pool_out,  # ANY, aliased to pool_in
    scr: StateScratch,  # VMEM f32 state of the head block, DMA semaphore, stage
    *, ratio: int, scale: float,
):  # fmt: skip
    chunk = q_ref.shape[2]
    hv = gates_ref.shape[0] // 2

    def compute(h0, length):
        row_ok = jax.lax.broadcasted_iota(jnp.int32, (1, chunk), 1) >= chunk - length  # [1, C]

        def head(jh, state):
            h = h0 + jh
            jk = jh // ratio
            q = l2norm(q_ref[jk, 0].astype(jnp.float32), axis=1) * scale
            k = l2norm(k_ref[jk, 0].astype(jnp.float32), axis=1)
            v = v_ref[jh, 0].astype(jnp.float32)
            a = a_ref[jh, 0].astype(jnp.float32)
            b = b_ref[jh, 0].astype(jnp.float32)
            g = jnp.where(row_ok, gates_ref[h] * softplus(a + gates_ref[hv + h]), 0.0)
            beta_col = row_to_col(jnp.where(row_ok, jax.nn.sigmoid(b), 0.0))  # [C, 1]
            return delta_rule_chunk(_gated_chunk(q, k, g, beta_col), v * beta_col, state)

        for_each_head(scr.state, o_ref, head)

    prefill_grid_step(p, pool_in, pool_out, scr, compute)


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

    oc, state = launch_prefill(
        _prefill_kernel,
        name="gdn_prefill",
        plan=plan,
        slots=slots,
        smem=gates,
        blocks=(qc, kc, vc, ac, bc),
        state=state,
        out=jax.ShapeDtypeStruct((hv, nc, CHUNK, dv), v.dtype),
        heads_per_block=hb,
        interpret=interpret,
        ratio=ratio,
        scale=float(dk) ** -0.5,
    )
    o = scatter_tokens(jnp.moveaxis(oc, 0, 2), plan)  # [T, Hv, Dv]
    return o, state


# ----------------------------------------------------------------------------- decode


def _decode_kernel(
    p: DecodePrefetch,  # SMEM: the slots
    gates_ref,  # SMEM f32[2 * Hv]
    q_ref, k_ref,  # [1, 1, Dk, HB]  columns
    v_ref,  # [1, 1, HB, Dv]
    a_ref, b_ref,  # [1, 1, 1, HB]
    s_in,  # [1, HB, Dv, Dk]  pool[src[r], heads], pipelined
    o_ref,  # [1, 1, HB, Dv]
    pool_out,  # ANY, aliased to the pool that s_in is read from
    scr: StateScratch,  # VMEM f32 state of the head block, DMA semaphore, stage
    *, scale: float,
):  # fmt: skip
    hv = gates_ref.shape[0] // 2

    def head(h, j):
        qc = l2norm(q_ref[0, 0, :, j : j + 1].astype(jnp.float32), axis=0) * scale
        kc = l2norm(k_ref[0, 0, :, j : j + 1].astype(jnp.float32), axis=0)  # [Dk, 1]
        a = a_ref[0, 0, :, j : j + 1].astype(jnp.float32)  # [1, 1]
        b = b_ref[0, 0, :, j : j + 1].astype(jnp.float32)
        v = v_ref[0, 0, j : j + 1, :].astype(jnp.float32)  # [1, Dv]
        g = gates_ref[h] * softplus(a + gates_ref[hv + h])
        return qc, kc, v, jax.nn.sigmoid(b), jnp.exp(g)

    decode_grid_step(p, s_in, o_ref, pool_out, scr, head)


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
    if rows != slots.num_rows:
        raise ValueError(f"decode rows {rows} must equal {slots.num_rows=} (one token each)")
    hb = _heads_per_block(hv, 1, heads_per_block or divisor_at_most(hv, 8))
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

    o, state = launch_decode(
        _decode_kernel,
        name="gdn_decode",
        slots=slots,
        smem=gates,
        blocks=(qc, kc, vb, ab, bb),
        state=state,
        out=jax.ShapeDtypeStruct((rows, nhb, hb, dv), v.dtype),
        interpret=interpret,
        scale=float(dk) ** -0.5,
    )
    return o.reshape(rows, hv, dv), state
