"""KDA Pallas kernels for NVIDIA GPUs (Triton lowering), with explicit state slots.

Same signatures and semantics as :mod:`pallas_kernels.kda.reference` (DESIGN.md §3), the
same slot contract and layout as the GDN kernels: tiles, slot loads and stores, the decode
program, the prefill windows and the row scan are :mod:`pallas_kernels.common.delta_rule_gpu`'s,
the chunk step :mod:`pallas_kernels.common.delta_rule`'s. The gate is computed in the kernel:
``g = -exp(A_log[h]) * softplus(g_raw + dt_bias[h])``, one per key channel. ``interpret=True``
runs them with Pallas' generic interpreter on CPU (how CI tests them).

Decode
------
grid = (S, H, Dv // BV); a program owns ``state[:, h, :, v0:v0+BV]`` of one row and decays its
rows per key channel: ``S = diag(exp(g)) S``.

Prefill (chunked form, 16-token chunks, one program per row, head and Dv block)
-------------------------------------------------------------------------------
The per-channel decay sits inside the intra-chunk dot products, so they are not plain
matmuls. With 16-token chunks the pairwise decays fit in registers and are computed directly
and stably (``exp`` only of ``gam_i - gam_j <= 0``, the upper triangle selected away before
the ``exp``); that is the gate part of the chunk step::

    gam   = cumsum(g) over the chunk's rows           [C, Dk]   (a lower-ones matmul)
    E     = exp(gam_i - gam_j)  for i >= j, else 0     [C, C, Dk]
    Akk   = strict_lower(beta_i sum_d k_i k_j E)       Aqk = incl_lower(sum_d q_i k_j E)

then ``Tm = (I + Akk)^-1``, W, U, Vnew, o and ``S = diag(exp(gam_last)) S + ...``, in the same
program: the serial scan runs the whole chunk step. Chunks are read as 16-row windows
(``T >= 16``: the wrapper pads shorter batches; the scheduler's checkpoint offsets are
multiples of 64, hence of 16). :func:`unsupported_reason` says which head dims ``hyjax.ops``
must leave to the reference. FLA's ``chunk_kda`` uses 64-token chunks with 16-row sub-blocks
and three kernels; this is the simple first form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common.chunking import max_chunks, plan_chunks
from pallas_kernels.common.delta_rule import (
    GatedChunk,
    delta_rule_chunk,
    group_refs,
    l2norm,
    mm,
    softplus,
)
from pallas_kernels.common.delta_rule_gpu import (
    DecodeSlots,
    RowPlan,
    check_key_dim,
    compiler_params,
    decode_program,
    launch_decode,
    pad_tokens,
    pick_block_v,
    row_plan,
    scan_row_chunks,
)
from pallas_kernels.common.delta_rule_gpu import unsupported_reason as unsupported_reason
from pallas_kernels.common.slots import StateSlots
from pallas_kernels.kda.reference import check_kda_args

CHUNK = 16


def _check(q, k, v, g, b, A_log, dt_bias, state, slots, qsl=None):
    check_kda_args(q, k, v, g, b, A_log, dt_bias, state, slots, qsl)
    check_key_dim(q.shape[-1])


# ----------------------------------------------------------------------------- decode


def _decode_kernel(
    p: DecodeSlots,
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
    def inputs(r, h, vs):
        q = l2norm(q_ref[r, h, :].astype(jnp.float32)) * scale  # [Dk]
        k = l2norm(k_ref[r, h, :].astype(jnp.float32))
        v = v_ref[r, h, vs].astype(jnp.float32)  # [BV]
        g = neg_a_ref[h] * softplus(g_ref[r, h, :].astype(jnp.float32) + dt_ref[h, :])  # [Dk]
        beta = jax.nn.sigmoid(b_ref[r, h].astype(jnp.float32))
        return q, k, v, beta, jnp.exp(g)[:, None]  # the state's rows, per key channel

    decode_program(p, pool_in, o_ref, pool_out, bv=bv, inputs=inputs)


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
    return launch_decode(
        _decode_kernel,
        name="kda_decode_gpu",
        slots=slots,
        inputs=(-jnp.exp(A_log.astype(jnp.float32)), dt_bias.astype(jnp.float32), q, k, g, v, b),
        state=state,
        out_dtype=v.dtype,
        bv=pick_block_v(dv, block_v),
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        scale=float(dk) ** -0.5,
    )


# ----------------------------------------------------------------------------- prefill


def _prefill_kernel(
    p: RowPlan,
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
    h, vb = pl.program_id(1), pl.program_id(2)
    vs = pl.ds(vb * bv, bv)
    num_tokens = q_ref.shape[0]
    c = CHUNK
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

    scan_row_chunks(p, pool_in, pool_out, vs=vs, num_tokens=num_tokens, chunk=CHUNK, step=step)


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
    bv = pick_block_v(dv, block_v)
    plan = plan_chunks(query_start_loc, slots, num_tokens=n, chunk=CHUNK)
    nc = max_chunks(n, rows, max_ckpt, CHUNK)
    tokens, tp = pad_tokens((q, k, g, v, b), CHUNK)  # the 16-row window needs T >= 16
    args = (
        *row_plan(plan, slots, nc),
        -jnp.exp(A_log.astype(jnp.float32)), dt_bias.astype(jnp.float32), *tokens, state,
    )  # fmt: skip
    kernel = group_refs(
        _prefill_kernel, RowPlan, bv=bv, scale=float(dk) ** -0.5, precision=precision
    )
    o, state = pl.pallas_call(
        kernel,
        grid=(rows, h, dv // bv),
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
