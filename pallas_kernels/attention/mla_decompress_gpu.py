"""MLA prefill chunks on the GPU with decompressed keys and values (Pallas, Triton lowering).

The absorbed kernel (:mod:`pallas_kernels.attention.mla_gpu`) costs ``2H(2L + R)`` flops per
(query, key) pair: 70k at Kimi-Linear-48B shapes, with a ``[rows, L = 512]`` f32 accumulator
per program that leaves Triton little room. A prefill chunk has many queries per context
token, so decompressing the context once and running ordinary flash attention over
``Dn + R = 192``-wide keys and ``Dv = 128``-wide values is cheaper: ``2H(Dn + R + Dv)`` = 20k
flops per pair plus ``2H L (Dn + Dv)`` = 8.4M per context token, paid once per chunk (not
once per query tile, which is why the decompression is not done per KV tile inside the
attention kernel: with 128 queries per program it would cost more than the absorbed form).

Two launches over a *transient* workspace (nothing is cached; the context is read only as
latents, through the block tables)::

    rows chosen:  q_len >= min_q, taken in order while their contexts fit the workspace
                  (W tokens, static); the others stay on the absorbed kernel
    workspace:    row s owns rows [ws_start[s], ws_start[s] + seq_lens[s]), in position order
    decompress:   grid (H, W / BW): k_nope[h, w] = c[w] @ W_uk[h], v[h, w] = c[w] @ W_uv[h]
                  (c gathered from the paged cache through the slot list; tiles past the
                  rows in use do nothing)
    attention:    grid (tiles, H): BQ tokens of one row and one head against the row's
                  workspace rows in BK blocks, causal; k_rope is read from the cache itself
                  (one R-wide row shared by all heads)

Requirements (Triton's ``arange`` and ``tl.dot``): Dn, Dv, R, L powers of two.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.attention.mla_absorb import _precision
from pallas_kernels.attention.paging_gpu import mm, softmax_init, softmax_step
from pallas_kernels.attention.tiles import cdiv, count_le, normalise_split, work_list


def _is_pow2(n: int) -> bool:
    return n > 0 and not n & (n - 1)


def _decompress_kernel(
    used_ref,  # i32[1]  workspace rows in use
    trips_ref,  # i32[Wp / BW]  L chunks of each tile: L / BL, 0 past the rows in use
    slot_ref,  # i32[Wp]  cache row of every workspace row (0 past the rows in use)
    lat_ref,  # [NB * bs, L + R]  the latent cache
    wk_ref,  # [H, L, Dn]  W_uk
    wv_ref,  # [H, L, Dv]  W_uv
    k_ref,  # [H, Wp, Dn]  out
    v_ref,  # [H, Wp, Dv]  out
    *, block_w: int, block_l: int, precision,
):  # fmt: skip
    h, i = pl.program_id(0), pl.program_id(1)  # heads fastest: a latent tile is read once
    used = used_ref[0]
    w_rows = pl.ds(i * block_w, block_w)
    ok = i * block_w + jnp.arange(block_w, dtype=jnp.int32) < used  # [BW]
    slot = pltr.load(slot_ref.at[w_rows], mask=ok, other=0)[:, None]  # [BW, 1]
    # a loaded trip count: a traced bound of literals fails Triton's scf.for verifier
    n_l = trips_ref[i]
    dn, dv = k_ref.shape[-1], v_ref.shape[-1]

    def body(c, acc):
        ak, av = acc
        cols = c * block_l + jnp.arange(block_l, dtype=jnp.int32)  # [BL]
        x = pltr.load(
            lat_ref.at[slot, cols[None, :]],
            mask=jnp.broadcast_to(ok[:, None], (block_w, block_l)),
            other=0.0,
        )  # [BW, BL]  fmt: skip
        wk = pltr.load(wk_ref.at[h, pl.ds(c * block_l, block_l), :])  # [BL, Dn]
        wv = pltr.load(wv_ref.at[h, pl.ds(c * block_l, block_l), :])  # [BL, Dv]
        ak = ak + mm(x, wk, ((1,), (0,)), precision)
        av = av + mm(x, wv, ((1,), (0,)), precision)
        return ak, av

    init = (jnp.zeros((block_w, dn), jnp.float32), jnp.zeros((block_w, dv), jnp.float32))
    ak, av = jax.lax.fori_loop(0, n_l, body, init)
    pltr.store(k_ref.at[h, w_rows, :], ak.astype(k_ref.dtype), mask=ok[:, None])
    pltr.store(v_ref.at[h, w_rows, :], av.astype(v_ref.dtype), mask=ok[:, None])


def _flash_kernel(
    tq0_ref, tnq_ref, tpos_ref, tws_ref,  # i32[NT] each: tile's first token, tokens, position, ws
    slot_ref,  # i32[Wp]
    qn_ref,  # [H, Tp, Dn]
    qr_ref,  # [H, Tp, R]
    k_ref,  # [H, Wp, Dn]
    v_ref,  # [H, Wp, Dv]
    lat_ref,  # [NB * bs, L + R]  (k_rope = a row's last R values)
    o_ref,  # f32[H, Tp, Dv]  rows of this tile's tokens
    *, bq: int, block_k: int, lora: int, rope: int, scale: float, precision,
):  # fmt: skip
    i, h = pl.program_id(0), pl.program_id(1)  # tiles fastest: a few heads' K/V in L2 at once
    q0, nq, pos0, ws0 = tq0_ref[i], tnq_ref[i], tpos_ref[i], tws_ref[i]
    t = jnp.arange(bq, dtype=jnp.int32)
    row_ok = t < nq  # [BQ]
    q_pos = pos0 + t
    q_rows = pl.ds(q0, bq)
    qn = pltr.load(qn_ref.at[h, q_rows, :], mask=row_ok[:, None], other=0.0)  # [BQ, Dn]
    qr = pltr.load(qr_ref.at[h, q_rows, :], mask=row_ok[:, None], other=0.0)  # [BQ, R]
    ctx = pos0 + nq  # keys [0, ctx) of this row; the last query sees them all
    cols_r = lora + jnp.arange(rope, dtype=jnp.int32)[None, :]

    def body(kb, carry):
        k_pos = kb * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [BK]
        k_ok = k_pos < ctx
        k_rows = pl.ds(ws0 + kb * block_k, block_k)
        kn = pltr.load(k_ref.at[h, k_rows, :], mask=k_ok[:, None], other=0.0)  # [BK, Dn]
        v = pltr.load(v_ref.at[h, k_rows, :], mask=k_ok[:, None], other=0.0)  # [BK, Dv]
        slot = pltr.load(slot_ref.at[k_rows], mask=k_ok, other=0)[:, None]  # [BK, 1]
        kr = pltr.load(
            lat_ref.at[slot, cols_r],
            mask=jnp.broadcast_to(k_ok[:, None], (block_k, rope)),
            other=0.0,
        )  # [BK, R]  fmt: skip
        s = mm(qn, kn, ((1,), (1,)), precision) + mm(qr, kr, ((1,), (1,)), precision)
        ok = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])  # [BQ, BK]
        return softmax_step(carry, s * scale, ok, v, precision)

    init = softmax_init(bq, v_ref.shape[-1])
    # the tile's last query is at ctx - 1: no key block past it is needed
    o, _, l = jax.lax.fori_loop(0, cdiv(ctx, block_k), body, init)
    o = normalise_split(o, l)
    pltr.store(o_ref.at[h, q_rows, :], o, mask=row_ok[:, None])


def workspace_tokens(
    num_tokens: int, num_rows: int, max_ctx: int, *, decompress_tokens: int, min_q: int
) -> int:
    """The workspace's static size: ``decompress_tokens``, or less where the batch's shapes
    bound the chosen rows' contexts (at most ``num_tokens // min_q`` rows of ``max_ctx``)."""
    rows = min(num_rows, num_tokens // max(1, min_q))
    return max(0, min(decompress_tokens, rows * max_ctx))


def choose_rows(
    q_len: jax.Array,  # i32[S]
    seq_lens: jax.Array,  # i32[S]
    live_row: jax.Array,  # bool[S]
    *,
    workspace: int,
    min_q: int,
) -> tuple[jax.Array, jax.Array]:
    """Rows with at least ``min_q`` new tokens whose contexts fit the workspace, in order.

    Returns (bool[S] chosen, i32[S] end of each row's workspace rows, 0-length if not chosen)."""
    want = live_row & (q_len >= min_q)
    fits = want & (jnp.cumsum(jnp.where(want, seq_lens, 0)) <= workspace)
    return fits, jnp.cumsum(jnp.where(fits, seq_lens, 0)).astype(jnp.int32)


def decompressed_attention(
    q: jax.Array,  # [T, H, Dn + R]
    latent_cache: jax.Array,  # [num_blocks, block_size, L + R]
    w_kv_b: jax.Array,  # [L, H, Dn + Dv]
    query_start_loc: jax.Array,  # i32[S+1]
    seq_lens: jax.Array,  # i32[S]
    block_tables: jax.Array,  # i32[S, max_blocks]
    chosen: jax.Array,  # bool[S]  rows to attend (from choose_rows)
    ws_end: jax.Array,  # i32[S]  their workspace ends (from choose_rows)
    *,
    nope_dim: int,
    scale: float,
    workspace: int,
    max_rows: int,
    block_q: int = 128,
    block_k: int = 32,
    block_w: int = 64,
    block_l: int = 64,
    num_warps: int = 8,
    num_stages: int = 2,
    num_warps_decompress: int = 4,
    num_stages_decompress: int = 2,
    interpret: bool = False,
) -> jax.Array:
    """Causal attention of the ``chosen`` rows' tokens over their decompressed contexts.

    ``max_rows``: a static bound on the chosen rows (tiles = that + T / block_q). Returns
    f32[T, H, Dv]; tokens of other rows hold anything (the caller selects)."""
    num_tokens, num_heads, qk = q.shape
    num_blocks, block_size, width = latent_cache.shape
    lora = w_kv_b.shape[0]
    rope = qk - nope_dim
    dv = w_kv_b.shape[2] - nope_dim
    for name, d in (("nope_dim", nope_dim), ("v_head_dim", dv), ("rope dims", rope)):
        if not _is_pow2(d):
            raise ValueError(f"{name}={d} must be a power of two for the decompressed prefill")
    if lora % block_l:
        raise ValueError(f"kv_lora_rank={lora} must be a multiple of {block_l=}")
    dtype = latent_cache.dtype
    prec = _precision(dtype)
    # padded so a block's row window (masked) never leaves the arrays, also when interpreted
    wp = cdiv(workspace + block_k, block_w) * block_w
    t_pad = num_tokens + block_q
    lat = latent_cache.reshape(num_blocks * block_size, width)
    lens = seq_lens.astype(jnp.int32)
    ws_start = ws_end - jnp.where(chosen, lens, 0)  # [S]
    used = ws_end[-1:]  # i32[1]

    # workspace row -> (row, position) -> cache row, loop-free
    w = jnp.arange(wp, dtype=jnp.int32)
    s = jnp.minimum(count_le(ws_end, w), ws_end.shape[0] - 1)  # [Wp]
    pos = w - ws_start[s]
    page = block_tables.astype(jnp.int32)[
        s, jnp.clip(pos // block_size, 0, block_tables.shape[1] - 1)
    ]
    slot = jnp.where(w < used[0], page * block_size + pos % block_size, 0)

    tile0 = jnp.arange(wp // block_w, dtype=jnp.int32) * block_w
    trips = jnp.where(tile0 < used[0], lora // block_l, 0).astype(jnp.int32)
    wt = w_kv_b.astype(dtype).transpose(1, 0, 2)  # [H, L, Dn + Dv]
    wk, wv = wt[..., :nope_dim], wt[..., nope_dim:]
    k, v = pl.pallas_call(
        functools.partial(
            _decompress_kernel, block_w=block_w, block_l=block_l, precision=prec
        ),  # fmt: skip
        grid=(num_heads, wp // block_w),
        out_shape=[
            jax.ShapeDtypeStruct((num_heads, wp, nope_dim), dtype),
            jax.ShapeDtypeStruct((num_heads, wp, dv), dtype),
        ],
        compiler_params=pltr.CompilerParams(
            num_warps=num_warps_decompress, num_stages=num_stages_decompress
        ),
        interpret=interpret,
        name="mla_decompress_context",
    )(used, trips, slot, lat, wk, wv)

    qsl = query_start_loc.astype(jnp.int32)
    q_len = qsl[1:] - qsl[:-1]
    cap = max_rows + num_tokens // block_q
    (tseq, tq0, tnq, tpos), _ = work_list(q_len, lens, qsl, chosen, bq=block_q, capacity=cap)
    # a row's last tiles see the most keys: launch them first (the list reversed)
    tq0, tnq, tpos, tws = (x[::-1] for x in (tq0, tnq, tpos, ws_start[tseq]))
    qh = jnp.pad(q.astype(dtype), ((0, t_pad - num_tokens), (0, 0), (0, 0))).transpose(1, 0, 2)
    o = pl.pallas_call(
        functools.partial(
            _flash_kernel,
            bq=block_q,
            block_k=block_k,
            lora=lora,
            rope=rope,
            scale=scale,
            precision=prec,
        ),  # fmt: skip
        grid=(cap, num_heads),
        out_shape=jax.ShapeDtypeStruct((num_heads, t_pad, dv), jnp.float32),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="mla_decompressed_prefill",
    )(tq0, tnq, tpos, tws, slot, qh[..., :nope_dim], qh[..., nope_dim:], k, v, lat)
    return o[:, :num_tokens].transpose(1, 0, 2)
