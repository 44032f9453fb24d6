"""Gated delta rule Pallas kernels for NVIDIA GPUs (Triton lowering), with explicit slots.

Same signatures and semantics as :mod:`pallas_kernels.gdn.reference` (DESIGN.md §3). The
kernels use ``jax.experimental.pallas.triton`` (masked loads/stores, ``tl.dot``); JAX 0.11
marks that lowering deprecated in favour of Mosaic GPU, but it is the one that compiles these
ragged, masked access patterns today. ``interpret=True`` runs them with Pallas' generic
interpreter on CPU (how the indexing logic is tested here); nothing below is tuned yet.

Decode (memory bound: one read of the source state, one write per destination)
------------------------------------------------------------------------------
grid = (S, Hv, Dv // BV); a program owns ``state[:, h, :, v0:v0+BV]`` of one row::

    S  = src > 0 ? pool[src, h, :, vblk] : 0           [Dk, BV] f32 (masked load: nothing read)
    S *= exp(g);  S += k (beta (v - S^T k))^T;  o = S^T q
    pool[dst, h, :, vblk] = S   (masked store: dst 0 writes nothing)
    pool[ckpt_slots[m], ...] = S where ckpt_offsets[m] == 1

Prefill (chunked WY/UT form, two launches)
------------------------------------------
The chunk plan of :mod:`pallas_kernels.common.chunking` cuts the ragged batch into chunks of
at most 64 tokens that never straddle sequences or checkpoint offsets. A chunk is read as a
64-row window whose start is clamped into ``[0, T - 64]``; rows outside the chunk are masked
to zero, which is exact (``g = beta = 0`` rows contribute nothing)::

    tokens:   ... | x x x [c c c c c] x x ... |        window = 64 rows starting at s0
    rows:          0 ...  ^start-s0  ^end-s0     63     mask = start <= s0 + i < start + len

1. ``_intra_kernel``, grid = (NC, Hv), every chunk in parallel: gates, ``gam = cumsum(g)``,
   ``A = beta k k^T * decay`` (strictly lower), ``T = (I + A)^-1`` by recursive doubling,
   ``W = T (beta e^gam k)`` and ``U = T (beta v)``; stored token-major (``[T, Hv, D]``, valid
   rows only), so the scratch is proportional to the tokens, not to the chunk capacity.
2. ``_scan_kernel``, grid = (S, Hv, Dv // BV): a program walks its row's chunks in order with
   ``S [Dk, BV]`` in registers: ``V' = U - W S``, ``o = (q e^gam) S + (q k^T * decay) V'``,
   ``S = e^gam_last S + (k e^(gam_last - gam))^T V'``, writing checkpoints and ``dst``.

The serial part is two Dk x BV matmuls per chunk plus the output's; the inverse, which
dominated the single-kernel version, runs once per (chunk, head) in the parallel launch.
Requirements: ``Dk`` a power of two, ``BV`` a power of two dividing ``Dv`` (by default the
largest one up to 32 or 64), ``T >= 64`` (the wrapper pads shorter batches);
:func:`unsupported_reason` says which head dims ``hyjax.ops`` must leave to the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common.chunking import max_chunks, plan_chunks
from pallas_kernels.common.slots import StateSlots
from pallas_kernels.gdn.reference import check_gdn_args

CHUNK = 64


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


# The narrowest tile a kernel here takes on a head dim (the tiny test models' Dv = 8). Narrower
# ones would run as Triton FMA loops nobody has compiled on a GPU: those models take the
# reference ops instead (``unsupported_reason``).
MIN_TILE = 8


def _block_v(dv: int, requested: int | None, default: int = 32) -> int:
    """The Dv columns a program owns: ``requested``, else the largest power of two dividing Dv
    up to ``default`` (Dv = 48: 16), so a Dv that is not a power of two still tiles exactly."""
    bv = min(dv & -dv, default) if requested is None else requested
    if not (_is_pow2(bv) and dv % bv == 0):
        raise ValueError(f"block_v={bv} must be a power of two dividing {dv=}")
    return bv


def unsupported_reason(dk: int, dv: int) -> str | None:
    """Why the kernels of this module (and the fused decode) cannot take these head dims, or
    None. Triton tiles are powers of two: a program holds all of Dk, and Dv in tiles of the
    largest power of two dividing it."""
    if not (_is_pow2(dk) and dk >= MIN_TILE):
        return f"key head dim {dk} is not a power of two >= {MIN_TILE} (one Triton tile holds Dk)"
    if dv & -dv < MIN_TILE:
        return f"value head dim {dv} has no power-of-two tile of >= {MIN_TILE} columns"
    return None


def _compiler_params(num_warps: int, num_stages: int):
    return pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _softplus(x):
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def _l2norm(x, axis=-1):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=axis, keepdims=True) + 1e-6)


def _mm(x, y, contract, precision):
    return jax.lax.dot_general(
        x, y, (contract, ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def _gates(gates_ref, h, a, b):
    """``g = -exp(A_log) softplus(a + dt_bias)`` and ``beta = sigmoid(b)`` for value head h."""
    g = gates_ref[0, h] * _softplus(a.astype(jnp.float32) + gates_ref[1, h])
    return g, jax.nn.sigmoid(b.astype(jnp.float32))


# ----------------------------------------------------------------------------- decode


def _decode_kernel(
    src_ref, dst_ref, ck_off_ref, ck_slot_ref, n_ref,  # i32[S], i32[S], i32[S, M] x2, i32[1]
    gates_ref,  # f32[2, Hv]: -exp(A_log), dt_bias
    q_ref, k_ref,  # [S, Hk, Dk]
    v_ref,  # [S, Hv, Dv]
    a_ref, b_ref,  # [S, Hv]
    pool_in,  # f32[num_slots, Hv, Dk, Dv]
    o_ref,  # [S, Hv, Dv]
    pool_out,  # aliased to pool_in
    *, bv: int, ratio: int, scale: float,
):  # fmt: skip
    r, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    vs = pl.ds(vb * bv, bv)
    dk = q_ref.shape[-1]
    live = r < n_ref[0]
    src, dst = src_ref[r], dst_ref[r]

    q = _l2norm(q_ref[r, h // ratio, :].astype(jnp.float32)) * scale  # [Dk]
    k = _l2norm(k_ref[r, h // ratio, :].astype(jnp.float32))
    v = v_ref[r, h, vs].astype(jnp.float32)  # [BV]
    g, beta = _gates(gates_ref, h, a_ref[r, h], b_ref[r, h])
    read = jnp.full((dk, bv), live & (src > 0))
    s = pltr.load(pool_in.at[src, h, :, vs], mask=read, other=0.0) * jnp.exp(g)  # [Dk, BV]
    pred = jnp.sum(s * k[:, None], axis=0)  # [BV] = S^T k
    s = s + k[:, None] * (beta * (v - pred))[None, :]
    o = jnp.sum(s * q[:, None], axis=0)
    o_ref[r, h, vs] = jnp.where(live, o, 0.0).astype(o_ref.dtype)

    pltr.store(pool_out.at[dst, h, :, vs], s, mask=jnp.full((dk, bv), live & (dst > 0)))
    for m in range(ck_off_ref.shape[1]):
        slot = ck_slot_ref[r, m]
        hit = live & (slot > 0) & (ck_off_ref[r, m] == 1)
        pltr.store(pool_out.at[slot, h, :, vs], s, mask=jnp.full((dk, bv), hit))


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
    if not _is_pow2(dk):
        raise ValueError(f"{dk=} must be a power of two for the Triton kernels")
    bv = _block_v(dv, block_v, default=64)  # H200 sweep at B=64: 64 columns, 4 warps
    args = (*slots.arrays(), _gate_params(A_log, dt_bias), q, k, v, a, b, state)
    kernel = functools.partial(_decode_kernel, bv=bv, ratio=hv // hk, scale=float(dk) ** -0.5)
    return pl.pallas_call(
        kernel,
        grid=(rows, hv, dv // bv),
        out_shape=[
            jax.ShapeDtypeStruct((rows, hv, dv), v.dtype),
            jax.ShapeDtypeStruct(state.shape, state.dtype),
        ],
        input_output_aliases={len(args) - 1: 1},
        compiler_params=_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="gdn_decode_gpu",
    )(*args)


def _gate_params(A_log, dt_bias):
    return jnp.stack([-jnp.exp(A_log.astype(jnp.float32)), dt_bias.astype(jnp.float32)])


# ----------------------------------------------------------------------------- prefill


def _window(start, length, num_tokens: int):
    """The 64-row window of a chunk (start clamped in bounds) and its valid-row mask."""
    w0 = jnp.minimum(start, num_tokens - CHUNK)
    tok = w0 + jnp.arange(CHUNK, dtype=jnp.int32)
    return pl.ds(w0, CHUNK), tok, (tok >= start) & (tok < start + length)


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
        win, _, valid = _window(start, length, num_tokens)
        c = CHUNK
        ii = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
        jj = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
        mm = functools.partial(_mm, precision=precision)
        k = pltr.load(k_ref.at[win, h // ratio, :], mask=valid[:, None], other=0.0)
        k = _l2norm(k.astype(jnp.float32))
        a = pltr.load(a_ref.at[win, h], mask=valid, other=0.0)
        b = pltr.load(b_ref.at[win, h], mask=valid, other=0.0)
        g, beta = _gates(gates_ref, h, a, b)
        g = jnp.where(valid, g, 0.0)
        beta = jnp.where(valid, beta, 0.0)
        gam = jnp.cumsum(g)  # [C]
        decay = jnp.exp(jnp.where(ii > jj, gam[:, None] - gam[None, :], -1e30))
        a_mat = beta[:, None] * mm(k, k, ((1,), (1,))) * decay  # strictly lower [C, C]
        tm = _unit_lower_inverse(a_mat, ii, jj, lambda x, y: mm(x, y, ((1,), (0,))))
        w = mm(tm, k * (beta * jnp.exp(gam))[:, None], ((1,), (0,)))  # [C, Dk]
        pltr.store(w_ref.at[win, h, :], w, mask=valid[:, None])
        dv = v_ref.shape[-1]
        bv = dv & -dv  # Dv itself when a power of two (one tile), else its largest such divisor
        for vb in range(dv // bv):
            vs = pl.ds(vb * bv, bv)
            v = pltr.load(v_ref.at[win, h, vs], mask=valid[:, None], other=0.0)
            u = mm(tm, v.astype(jnp.float32) * beta[:, None], ((1,), (0,)))  # [C, BV]
            pltr.store(u_ref.at[win, h, vs], u, mask=valid[:, None])
        pltr.store(gam_ref.at[win, h], gam, mask=valid)


def _scan_kernel(
    row_first_ref, row_chunks_ref,  # i32[S]: first chunk of each row in the plan, chunk count
    c_start_ref, c_len_ref, c_end_ref,  # i32[NC]
    src_ref, dst_ref, ck_off_ref, ck_slot_ref,  # i32[S], i32[S], i32[S, M] x2
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
    r, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    vs = pl.ds(vb * bv, bv)
    num_tokens, _, dk = q_ref.shape
    hk = h // ratio
    n_chunks = row_chunks_ref[r]
    src, dst = src_ref[r], dst_ref[r]
    c = CHUNK
    ii = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    jj = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    mm = functools.partial(_mm, precision=precision)

    read = jnp.full((dk, bv), (n_chunks > 0) & (src > 0))
    s0 = pltr.load(pool_in.at[src, h, :, vs], mask=read, other=0.0)  # [Dk, BV]

    def chunk_step(i, s):
        ci = row_first_ref[r] + i
        start, length, end = c_start_ref[ci], c_len_ref[ci], c_end_ref[ci]
        win, tok, valid = _window(start, length, num_tokens)
        q = pltr.load(q_ref.at[win, hk, :], mask=valid[:, None], other=0.0)
        k = pltr.load(k_ref.at[win, hk, :], mask=valid[:, None], other=0.0)
        q = _l2norm(q.astype(jnp.float32)) * scale
        k = _l2norm(k.astype(jnp.float32))
        w = pltr.load(w_ref.at[win, h, :], mask=valid[:, None], other=0.0)  # [C, Dk]
        u = pltr.load(u_ref.at[win, h, vs], mask=valid[:, None], other=0.0)  # [C, BV]
        gam = pltr.load(gam_ref.at[win, h], mask=valid, other=0.0)  # [C]
        gam_last = jnp.sum(jnp.where(tok == start + length - 1, gam, 0.0))
        # Invalid rows read gam = 0: mask them out of the decay (no exp overflow).
        both = valid[:, None] & valid[None, :] & (ii >= jj)
        decay = jnp.exp(jnp.where(both, gam[:, None] - gam[None, :], -1e30))
        vnew = u - mm(w, s, ((1,), (0,)))  # [C, BV]
        qk = mm(q, k, ((1,), (1,))) * decay  # [C, C]
        o = mm(q * jnp.exp(gam)[:, None], s, ((1,), (0,))) + mm(qk, vnew, ((1,), (0,)))
        pltr.store(o_ref.at[win, h, vs], o.astype(o_ref.dtype), mask=valid[:, None])
        k_dec = k * jnp.exp(gam_last - gam)[:, None]
        s = s * jnp.exp(gam_last) + mm(k_dec, vnew, ((0,), (0,)))
        for m in range(ck_off_ref.shape[1]):
            slot = ck_slot_ref[r, m]
            hit = (slot > 0) & (ck_off_ref[r, m] == end)
            pltr.store(pool_out.at[slot, h, :, vs], s, mask=jnp.full((dk, bv), hit))
        last = (i == n_chunks - 1) & (dst > 0)
        pltr.store(pool_out.at[dst, h, :, vs], s, mask=jnp.full((dk, bv), last))
        return s

    jax.lax.fori_loop(0, n_chunks, chunk_step, s0)


def _state_kernel(
    row_first_ref, row_chunks_ref,  # i32[S]
    c_start_ref, c_len_ref, c_end_ref,  # i32[NC]
    src_ref, dst_ref, ck_off_ref, ck_slot_ref,  # i32[S], i32[S], i32[S, M] x2
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
    r, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    vs = pl.ds(vb * bv, bv)
    num_tokens, _, dk = k_ref.shape
    n_chunks = row_chunks_ref[r]
    src, dst = src_ref[r], dst_ref[r]
    mm = functools.partial(_mm, precision=precision)
    read = jnp.full((dk, bv), (n_chunks > 0) & (src > 0))
    s0 = pltr.load(pool_in.at[src, h, :, vs], mask=read, other=0.0)  # [Dk, BV]

    def chunk_step(i, s):
        ci = row_first_ref[r] + i
        start, length, end = c_start_ref[ci], c_len_ref[ci], c_end_ref[ci]
        win, tok, valid = _window(start, length, num_tokens)
        h_ref[ci, h, :, vs] = s
        k = pltr.load(k_ref.at[win, h // ratio, :], mask=valid[:, None], other=0.0)
        k = _l2norm(k.astype(jnp.float32))
        w = pltr.load(w_ref.at[win, h, :], mask=valid[:, None], other=0.0)  # [C, Dk]
        u = pltr.load(u_ref.at[win, h, vs], mask=valid[:, None], other=0.0)  # [C, BV]
        gam = pltr.load(gam_ref.at[win, h], mask=valid, other=0.0)  # [C]
        gam_last = jnp.sum(jnp.where(tok == start + length - 1, gam, 0.0))
        vnew = u - mm(w, s, ((1,), (0,)))  # [C, BV]
        pltr.store(vnew_ref.at[win, h, vs], vnew, mask=valid[:, None])
        k_dec = k * jnp.exp(gam_last - gam)[:, None]
        s = s * jnp.exp(gam_last) + mm(k_dec, vnew, ((0,), (0,)))
        for m in range(ck_off_ref.shape[1]):
            slot = ck_slot_ref[r, m]
            hit = (slot > 0) & (ck_off_ref[r, m] == end)
            pltr.store(pool_out.at[slot, h, :, vs], s, mask=jnp.full((dk, bv), hit))
        last = (i == n_chunks - 1) & (dst > 0)
        pltr.store(pool_out.at[dst, h, :, vs], s, mask=jnp.full((dk, bv), last))
        return s

    jax.lax.fori_loop(0, n_chunks, chunk_step, s0)


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
        mm = functools.partial(_mm, precision=precision)
        win, _, valid = _window(start, length, num_tokens)
        q = pltr.load(q_ref.at[win, h // ratio, :], mask=valid[:, None], other=0.0)
        k = pltr.load(k_ref.at[win, h // ratio, :], mask=valid[:, None], other=0.0)
        q = _l2norm(q.astype(jnp.float32)) * scale
        k = _l2norm(k.astype(jnp.float32))
        gam = pltr.load(gam_ref.at[win, h], mask=valid, other=0.0)
        vnew = pltr.load(vnew_ref.at[win, h, vs], mask=valid[:, None], other=0.0)
        both = valid[:, None] & valid[None, :] & (ii >= jj)
        decay = jnp.exp(jnp.where(both, gam[:, None] - gam[None, :], -1e30))
        qk = mm(q, k, ((1,), (1,))) * decay
        o = mm(q * jnp.exp(gam)[:, None], h_ref[ci, h, :, vs], ((1,), (0,)))
        o = o + mm(qk, vnew, ((1,), (0,)))
        pltr.store(o_ref.at[win, h, vs], o.astype(o_ref.dtype), mask=valid[:, None])


def _unit_lower_inverse(a, ii, jj, mm):
    """``(I + a)^-1`` for strictly lower ``a``: recursive 2x2 block inversion (see tpu.py)."""
    n = a.shape[0]
    x = (ii == jj).astype(jnp.float32)
    s = 1
    while s < n:
        c = jnp.where((ii // (2 * s) == jj // (2 * s)) & (ii // s != jj // s), a, 0.0)
        x = x - mm(x, mm(c, x))
        s *= 2
    return x


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
    if not _is_pow2(dk):
        raise ValueError(f"{dk=} must be a power of two for the Triton kernels")
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
    pad = max(0, CHUNK - n)  # the 64-row window needs T >= 64

    def padded(x):
        return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) if pad else x

    q, k, v, a, b = map(padded, (q, k, v, a, b))
    tp = n + pad
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
        compiler_params=_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="gdn_prefill_intra_gpu",
    )(plan.start, plan.length, gates, k, v, a, b)
    slot_args = (
        row_first, row_chunks, plan.start, plan.length, plan.end, *slots.arrays()[:4],
    )  # fmt: skip
    params = _compiler_params(num_warps, num_stages)
    scale = float(dk) ** -0.5
    if three_launches is None:  # the per-chunk states must fit the scratch budget
        three_launches = nc * hv * dk * dv * 4 <= max_scratch_bytes
    if not three_launches:
        args = (*slot_args, q, k, w, u, gam, state)
        o, state = pl.pallas_call(
            functools.partial(
                _scan_kernel, bv=bv, ratio=hv // hk, scale=scale, precision=precision
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
        args = (*slot_args, k, w, u, gam, state)
        h_all, vnew, state = pl.pallas_call(
            functools.partial(_state_kernel, bv=bv, ratio=hv // hk, precision=precision),
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
        bo = _block_v(dv, block_v_out, default=64)
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
