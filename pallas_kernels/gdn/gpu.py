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

Decode
------
grid = (S, Hv, Dv // BV); a program owns ``state[:, h, :, v0:v0+BV]`` of one row and decays it
by ``exp(g)``, ``g = -exp(A_log) softplus(a + dt_bias)``.

Prefill (chunked WY/UT form, two launches)
------------------------------------------
Chunks of at most 64 tokens, each read as a 64-row window (``T >= 64``: the wrapper pads
shorter batches).

1. ``_intra_kernel``, grid = (NC, Hv), every chunk in parallel: gates, ``gam = cumsum(g)``,
   ``A = beta k k^T * decay`` (strictly lower), ``T = (I + A)^-1`` by recursive doubling,
   ``W = T (beta e^gam k)`` and ``U = T (beta v)``; stored token-major (``[T, Hv, D]``, valid
   rows only), so the scratch is proportional to the tokens, not to the chunk capacity.
2. ``_scan_kernel``, grid = (S, Hv, Dv // BV): a program walks its row's chunks in order with
   ``S [Dk, BV]`` in registers: ``V' = U - W S``, ``o = (q e^gam) S + (q k^T * decay) V'``,
   ``S = e^gam_last S + (k e^(gam_last - gam))^T V'``, writing checkpoints and ``dst``.

The serial part is two Dk x BV matmuls per chunk plus the output's; the inverse, which
dominated the single-kernel version, runs once per (chunk, head) in the parallel launch.
``three_launches`` moves the output out of the scan (``_state_kernel`` then
``_output_kernel``). Requirements: ``Dk`` a power of two, ``BV`` a power of two dividing ``Dv``
(by default the largest one up to 32 or 64); :func:`unsupported_reason` says which head dims
``hyjax.ops`` must leave to the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common.chunking import max_chunks, plan_chunks
from pallas_kernels.common.delta_rule import (
    NT,
    TN,
    chunk_recurrence,
    group_refs,
    l2norm,
    mm,
    softplus,
    unit_lower_inverse,
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
    window,
)
from pallas_kernels.common.delta_rule_gpu import unsupported_reason as unsupported_reason
from pallas_kernels.common.slots import StateSlots
from pallas_kernels.gdn.reference import check_gdn_args

CHUNK = 64


def _gates(gates_ref, h, a, b):
    """``g = -exp(A_log) softplus(a + dt_bias)`` and ``beta = sigmoid(b)`` for value head h."""
    g = gates_ref[0, h] * softplus(a.astype(jnp.float32) + gates_ref[1, h])
    return g, jax.nn.sigmoid(b.astype(jnp.float32))


def _gate_params(A_log, dt_bias):
    return jnp.stack([-jnp.exp(A_log.astype(jnp.float32)), dt_bias.astype(jnp.float32)])


# ----------------------------------------------------------------------------- decode


def _decode_kernel(
    p: DecodeSlots,
    gates_ref,  # f32[2, Hv]: -exp(A_log), dt_bias
    q_ref, k_ref,  # [S, Hk, Dk]
    v_ref,  # [S, Hv, Dv]
    a_ref, b_ref,  # [S, Hv]
    pool_in,  # f32[num_slots, Hv, Dk, Dv]
    o_ref,  # [S, Hv, Dv]
    pool_out,  # aliased to pool_in
    *, bv: int, ratio: int, scale: float,
):  # fmt: skip
    def inputs(r, h, vs):
        q = l2norm(q_ref[r, h // ratio, :].astype(jnp.float32)) * scale  # [Dk]
        k = l2norm(k_ref[r, h // ratio, :].astype(jnp.float32))
        v = v_ref[r, h, vs].astype(jnp.float32)  # [BV]
        g, beta = _gates(gates_ref, h, a_ref[r, h], b_ref[r, h])
        return q, k, v, beta, jnp.exp(g)

    decode_program(p, pool_in, o_ref, pool_out, bv=bv, inputs=inputs)


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
    block_v: int | None = None,
    num_warps: int = 4,
    num_stages: int = 1,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """One token per row; see the module docstring. Returns ``(o [S, Hv, Dv], state)``."""
    check_gdn_args(q, k, v, a, b, A_log, dt_bias, state, slots)
    rows, hk, dk = q.shape
    _, hv, dv = v.shape
    if rows != slots.num_rows:
        raise ValueError(f"decode rows {rows} must equal {slots.num_rows=} (one token each)")
    check_key_dim(dk)
    return launch_decode(
        _decode_kernel,
        name="gdn_decode_gpu",
        slots=slots,
        inputs=(_gate_params(A_log, dt_bias), q, k, v, a, b),
        state=state,
        out_dtype=v.dtype,
        bv=pick_block_v(dv, block_v, default=64),  # H200 sweep at B=64: 64 columns, 4 warps
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        ratio=hv // hk,
        scale=float(dk) ** -0.5,
    )


# ----------------------------------------------------------------------------- prefill


def _intra_kernel(
    c_start_ref, c_len_ref,  # i32[NC]
    gates_ref,  # f32[2, Hv]
    k_ref,  # [Tp, Hk, Dk]
    v_ref,  # [Tp, Hv, Dv]
    a_ref, b_ref,  # [Tp, Hv]
    w_ref,  # f32[Tp, Hv, Dk]  out: W = T (beta e^gam k), token-major, valid rows only
    u_ref,  # f32[Tp, Hv, Dv]  out: U = T (beta v)
    gam_ref,  # f32[Tp, Hv]     out: cumulative log-decay inside the chunk
    *, ratio: int, precision,
):  # fmt: skip
    """Kernel 1, one program per (chunk, value head), all in parallel: the chunk's UT form."""
    ci, h = pl.program_id(0), pl.program_id(1)
    start, length = c_start_ref[ci], c_len_ref[ci]
    num_tokens = k_ref.shape[0]

    @pl.when(length > 0)
    def _():
        win = window(start, length, num_tokens, CHUNK)
        valid = win.valid
        c = CHUNK
        ii = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
        jj = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
        k = pltr.load(k_ref.at[win.rows, h // ratio, :], mask=valid[:, None], other=0.0)
        k = l2norm(k.astype(jnp.float32))
        a = pltr.load(a_ref.at[win.rows, h], mask=valid, other=0.0)
        b = pltr.load(b_ref.at[win.rows, h], mask=valid, other=0.0)
        g, beta = _gates(gates_ref, h, a, b)
        g = jnp.where(valid, g, 0.0)
        beta = jnp.where(valid, beta, 0.0)
        gam = jnp.cumsum(g)  # [C]
        decay = jnp.exp(jnp.where(ii > jj, gam[:, None] - gam[None, :], -1e30))
        a_mat = beta[:, None] * mm(k, k, NT, precision) * decay  # strictly lower [C, C]
        tm = unit_lower_inverse(a_mat, precision)
        w = mm(tm, k * (beta * jnp.exp(gam))[:, None], precision=precision)  # [C, Dk]
        pltr.store(w_ref.at[win.rows, h, :], w, mask=valid[:, None])
        dv = v_ref.shape[-1]
        bv = dv & -dv  # Dv itself when a power of two (one tile), else its largest such divisor
        for vb in range(dv // bv):
            vs = pl.ds(vb * bv, bv)
            v = pltr.load(v_ref.at[win.rows, h, vs], mask=valid[:, None], other=0.0)
            u = mm(tm, v.astype(jnp.float32) * beta[:, None], precision=precision)  # [C, BV]
            pltr.store(u_ref.at[win.rows, h, vs], u, mask=valid[:, None])
        pltr.store(gam_ref.at[win.rows, h], gam, mask=valid)


def _scan_kernel(
    p: RowPlan,
    q_ref, k_ref,  # [Tp, Hk, Dk]
    w_ref,  # f32[Tp, Hv, Dk]
    u_ref,  # f32[Tp, Hv, Dv]
    gam_ref,  # f32[Tp, Hv]
    pool_in,  # f32[num_slots, Hv, Dk, Dv]
    o_ref,  # [Tp, Hv, Dv]  (rows outside every chunk are left unwritten)
    pool_out,
    *, bv: int, ratio: int, scale: float, precision,
):  # fmt: skip
    """Kernel 2, one program per (row, value head, Dv block): the state walks the chunks."""
    h, vb = pl.program_id(1), pl.program_id(2)
    vs = pl.ds(vb * bv, bv)
    num_tokens = q_ref.shape[0]
    hk = h // ratio
    c = CHUNK
    ii = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    jj = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)

    def step(ci, win, s):
        valid = win.valid
        q = pltr.load(q_ref.at[win.rows, hk, :], mask=valid[:, None], other=0.0)
        k = pltr.load(k_ref.at[win.rows, hk, :], mask=valid[:, None], other=0.0)
        q = l2norm(q.astype(jnp.float32)) * scale
        k = l2norm(k.astype(jnp.float32))
        w = pltr.load(w_ref.at[win.rows, h, :], mask=valid[:, None], other=0.0)  # [C, Dk]
        u = pltr.load(u_ref.at[win.rows, h, vs], mask=valid[:, None], other=0.0)  # [C, BV]
        gam = pltr.load(gam_ref.at[win.rows, h], mask=valid, other=0.0)  # [C]
        gam_last = jnp.sum(jnp.where(win.tok == win.start + win.length - 1, gam, 0.0))
        # Invalid rows read gam = 0: mask them out of the decay (no exp overflow).
        both = valid[:, None] & valid[None, :] & (ii >= jj)
        decay = jnp.exp(jnp.where(both, gam[:, None] - gam[None, :], -1e30))
        qk = mm(q, k, NT, precision) * decay  # [C, C]
        q_dec = q * jnp.exp(gam)[:, None]
        k_dec = k * jnp.exp(gam_last - gam)[:, None]
        o, s = chunk_recurrence(s, w, u, q_dec, qk, k_dec, jnp.exp(gam_last), precision)
        pltr.store(o_ref.at[win.rows, h, vs], o.astype(o_ref.dtype), mask=valid[:, None])
        return s

    scan_row_chunks(p, pool_in, pool_out, vs=vs, num_tokens=num_tokens, chunk=CHUNK, step=step)


def _state_kernel(
    p: RowPlan,
    k_ref,  # [Tp, Hk, Dk]
    w_ref,  # f32[Tp, Hv, Dk]
    u_ref,  # f32[Tp, Hv, Dv]
    gam_ref,  # f32[Tp, Hv]
    pool_in,  # f32[num_slots, Hv, Dk, Dv]
    h_ref,  # f32[NC, Hv, Dk, Dv]  out: the state before each chunk
    vnew_ref,  # f32[Tp, Hv, Dv]   out: V' = U - W S, token-major
    pool_out,
    *, bv: int, ratio: int, precision,
):  # fmt: skip
    """Kernel 2 of the three-launch path: only the state recurrence is serial."""
    h, vb = pl.program_id(1), pl.program_id(2)
    vs = pl.ds(vb * bv, bv)
    num_tokens = k_ref.shape[0]

    def step(ci, win, s):
        valid = win.valid
        h_ref[ci, h, :, vs] = s
        k = pltr.load(k_ref.at[win.rows, h // ratio, :], mask=valid[:, None], other=0.0)
        k = l2norm(k.astype(jnp.float32))
        w = pltr.load(w_ref.at[win.rows, h, :], mask=valid[:, None], other=0.0)  # [C, Dk]
        u = pltr.load(u_ref.at[win.rows, h, vs], mask=valid[:, None], other=0.0)  # [C, BV]
        gam = pltr.load(gam_ref.at[win.rows, h], mask=valid, other=0.0)  # [C]
        gam_last = jnp.sum(jnp.where(win.tok == win.start + win.length - 1, gam, 0.0))
        vnew = u - mm(w, s, precision=precision)  # [C, BV]
        pltr.store(vnew_ref.at[win.rows, h, vs], vnew, mask=valid[:, None])
        k_dec = k * jnp.exp(gam_last - gam)[:, None]
        return s * jnp.exp(gam_last) + mm(k_dec, vnew, TN, precision)

    scan_row_chunks(p, pool_in, pool_out, vs=vs, num_tokens=num_tokens, chunk=CHUNK, step=step)


def _output_kernel(
    c_start_ref, c_len_ref,  # i32[NC]
    q_ref, k_ref,  # [Tp, Hk, Dk]
    gam_ref,  # f32[Tp, Hv]
    h_ref,  # f32[NC, Hv, Dk, Dv]
    vnew_ref,  # f32[Tp, Hv, Dv]
    o_ref,  # [Tp, Hv, Dv]
    *, bv: int, ratio: int, scale: float, precision,
):  # fmt: skip
    """Kernel 3 of the three-launch path, every (chunk, head, Dv block) in parallel."""
    ci, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    vs = pl.ds(vb * bv, bv)
    start, length = c_start_ref[ci], c_len_ref[ci]
    num_tokens = q_ref.shape[0]

    @pl.when(length > 0)
    def _():
        c = CHUNK
        ii = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
        jj = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
        win = window(start, length, num_tokens, CHUNK)
        valid = win.valid
        q = pltr.load(q_ref.at[win.rows, h // ratio, :], mask=valid[:, None], other=0.0)
        k = pltr.load(k_ref.at[win.rows, h // ratio, :], mask=valid[:, None], other=0.0)
        q = l2norm(q.astype(jnp.float32)) * scale
        k = l2norm(k.astype(jnp.float32))
        gam = pltr.load(gam_ref.at[win.rows, h], mask=valid, other=0.0)
        vnew = pltr.load(vnew_ref.at[win.rows, h, vs], mask=valid[:, None], other=0.0)
        both = valid[:, None] & valid[None, :] & (ii >= jj)
        decay = jnp.exp(jnp.where(both, gam[:, None] - gam[None, :], -1e30))
        qk = mm(q, k, NT, precision) * decay
        o = mm(q * jnp.exp(gam)[:, None], h_ref[ci, h, :, vs], precision=precision)
        o = o + mm(qk, vnew, precision=precision)
        pltr.store(o_ref.at[win.rows, h, vs], o.astype(o_ref.dtype), mask=valid[:, None])


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
    block_v: int | None = None,
    precision=jax.lax.Precision.HIGHEST,
    num_warps: int = 4,
    num_stages: int = 2,
    three_launches: bool | None = None,
    max_scratch_bytes: int = 512 * 1024 * 1024,
    block_v_out: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Chunked ragged prefill; see the module docstring. Returns ``(o [T, Hv, Dv], state)``.

    ``precision`` is the matmul precision inside the chunk (``HIGHEST``: IEEE f32; a
    ``DotAlgorithmPreset`` such as ``BF16_BF16_F32_X3`` or ``DEFAULT`` (TF32) trade accuracy
    for tensor-core speed). ``three_launches`` moves the output out of the serial scan into a
    parallel launch, at the cost of a scratch of every chunk's starting state (f32
    ``[NC, Hv, Dk, Dv]``); by default it is used when that scratch fits
    ``max_scratch_bytes`` (long prefills; decode-heavy mixed batches have many small chunks).
    """
    check_gdn_args(q, k, v, a, b, A_log, dt_bias, state, slots, query_start_loc)
    n, hk, dk = q.shape
    _, hv, dv = v.shape
    rows, max_ckpt = slots.ckpt_offsets.shape
    check_key_dim(dk)
    bv = pick_block_v(dv, block_v)
    plan = plan_chunks(query_start_loc, slots, num_tokens=n, chunk=CHUNK)
    nc = max_chunks(n, rows, max_ckpt, CHUNK)
    rp = row_plan(plan, slots, nc)
    (q, k, v, a, b), tp = pad_tokens((q, k, v, a, b), CHUNK)  # the 64-row window needs T >= 64
    gates = _gate_params(A_log, dt_bias)
    f32 = jnp.float32
    w, u, gam = pl.pallas_call(
        functools.partial(_intra_kernel, ratio=hv // hk, precision=precision),
        grid=(nc, hv),
        out_shape=[
            jax.ShapeDtypeStruct((tp, hv, dk), f32),
            jax.ShapeDtypeStruct((tp, hv, dv), f32),
            jax.ShapeDtypeStruct((tp, hv), f32),
        ],
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="gdn_prefill_intra_gpu",
    )(plan.start, plan.length, gates, k, v, a, b)
    params = compiler_params(num_warps, num_stages)
    scale = float(dk) ** -0.5
    if three_launches is None:  # the per-chunk states must fit the scratch budget
        three_launches = nc * hv * dk * dv * 4 <= max_scratch_bytes
    if not three_launches:
        args = (*rp, q, k, w, u, gam, state)
        o, state = pl.pallas_call(
            group_refs(
                _scan_kernel, RowPlan, bv=bv, ratio=hv // hk, scale=scale, precision=precision
            ),
            grid=(rows, hv, dv // bv),
            out_shape=[
                jax.ShapeDtypeStruct((tp, hv, dv), v.dtype),
                jax.ShapeDtypeStruct(state.shape, state.dtype),
            ],
            input_output_aliases={len(args) - 1: 1},
            compiler_params=params,
            interpret=interpret,
            name="gdn_prefill_scan_gpu",
        )(*args)
    else:
        args = (*rp, k, w, u, gam, state)
        h_all, vnew, state = pl.pallas_call(
            group_refs(_state_kernel, RowPlan, bv=bv, ratio=hv // hk, precision=precision),
            grid=(rows, hv, dv // bv),
            out_shape=[
                jax.ShapeDtypeStruct((nc, hv, dk, dv), f32),
                jax.ShapeDtypeStruct((tp, hv, dv), f32),
                jax.ShapeDtypeStruct(state.shape, state.dtype),
            ],
            input_output_aliases={len(args) - 1: 2},
            compiler_params=params,
            interpret=interpret,
            name="gdn_prefill_state_gpu",
        )(*args)
        bo = pick_block_v(dv, block_v_out, default=64)
        o = pl.pallas_call(
            functools.partial(
                _output_kernel, bv=bo, ratio=hv // hk, scale=scale, precision=precision
            ),
            grid=(nc, hv, dv // bo),
            out_shape=jax.ShapeDtypeStruct((tp, hv, dv), v.dtype),
            compiler_params=params,
            interpret=interpret,
            name="gdn_prefill_output_gpu",
        )(plan.start, plan.length, q, k, gam, h_all, vnew)
    return jnp.where(plan.live[:, None, None], o[:n], 0).astype(v.dtype), state
