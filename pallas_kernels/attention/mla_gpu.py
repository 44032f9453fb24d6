"""MLA on the paged latent cache for NVIDIA GPUs in Pallas (Triton lowering), one call per step.

``mla_prefill`` / ``mla_decode`` have the reference ops' signatures
(:mod:`pallas_kernels.attention.mla_reference`); both absorb ``kv_b_proj`` around one latent
attention kernel (:mod:`pallas_kernels.attention.mla_absorb`), so decode rows and prefill
chunks share a launch scheme and the context is read only as latents, through the block tables.
In ``mla_prefill`` rows with many new tokens (>= 256 by default, 16-bit caches) instead run on
keys and values decompressed per call into a transient workspace
(:mod:`pallas_kernels.attention.mla_decompress_gpu`; 6-11x faster on an H100 for 1-4k-token
chunks, BENCHMARKS.md); the rest of the batch stays here, in the same call.

Latent attention is MQA with a single kv head of width L + R and value width L, so the layout
follows :mod:`pallas_kernels.attention.gpu` with the query heads in the role of a GQA group: the
wrapper regroups ``q_abs [T, H, L+R]`` into head blocks of ``HB`` heads, ``[H/HB, Tp*HB, *]``
(the L part and the R part as two arrays: Triton's ``arange`` wants powers of two), and a
program takes ``BQ`` tokens x ``HB`` heads = ``M`` rows against each key block, reading every
latent row once for all of them::

    work item (head block g, tile i, split j):           grid = (H/HB, NT, splits), g fastest
      rows    r = t * HB + h: token q0 + t (t < nq), head g * HB + h
      keys    [0, pos0 + nq) in BK-token blocks; split j takes its share of them
      key p -> row block_tables[seq, p // bs] * bs + p % bs of the cache as [NB*bs, L+R]
               c = row[:L] (key and value), k_r = row[L:] (key only); masked past the context
      s = scale * (q_lat c^T + q_rope k_r^T)   [M, BK];   acc += softmax-weights @ c   [M, L]

Head blocks of one tile run side by side (``g`` is the fastest grid axis), so a latent block
read by one is in L2 for the others. Two launches, as for GQA: short rows (decode, a few
speculative tokens: ``BQ * HB = 16`` rows, the smallest ``tl.dot``) and long rows (prefill
chunks, ``rows_prefill`` rows). Decode at long contexts splits the keys (flash-decoding) so a
launch has about ``target_programs`` programs; float32 partials merge by log-sum-exp. The
split loop, the launches and the merge are :mod:`pallas_kernels.attention.paging_gpu`'s,
shared with GQA.

Requirements: L, R and ``HB`` powers of two (Kimi-Linear: 512, 64; HB = 16); heads are padded
to a multiple of ``HB``; the cache has < 2**31 elements (Triton's 32-bit offsets: about 3.7M
tokens per layer at L + R = 576).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.attention.mla_absorb import (
    _precision,
    absorb_output,
    absorb_query,
    absorbed_decode,
)
from pallas_kernels.attention.mla_decompress_gpu import (
    choose_rows,
    decompressed_attention,
    workspace_tokens,
)
from pallas_kernels.attention.mla_reference import check_mla_args
from pallas_kernels.attention.paging_gpu import (
    Launch,
    attend_split,
    mm,
    split_launches,
    store_partial,
)
from pallas_kernels.attention.tiles import cdiv, next_pow2, token_rows

# The narrowest latent tile (the tiny test model's rope dims); narrower ones would run as FMA
# loops never compiled on a GPU.
MIN_TILE = 8


def _is_pow2(n: int) -> bool:
    return n > 0 and not n & (n - 1)


def unsupported_reason(kv_lora_rank: int, rope_dim: int) -> str | None:
    """Why the latent kernel cannot take these dims, or None (``hyjax.ops`` then uses the
    reference ops for the model). The decompressed prefill path has its own rule and is left
    out, not failed, where it does not hold (:func:`mla_prefill`)."""
    for name, d in (("kv_lora_rank", kv_lora_rank), ("rope dims", rope_dim)):
        if not (_is_pow2(d) and d >= MIN_TILE):
            return f"{name} {d} is not a power of two >= {MIN_TILE} (a Triton tile)"
    return None


def _kernel(
    tseq_ref, tq0_ref, tnq_ref, tpos_ref,  # i32[NT] each: the work list (nq = 0: empty tile)
    bt_ref,  # i32[S * max_blocks]  block tables, flattened
    qn_ref,  # [H/HB, Tp * HB, L]  absorbed queries, latent part
    qr_ref,  # [H/HB, Tp * HB, R]  rope part
    lat_ref,  # [NB * bs, L + R]  the latent cache, one row per token slot
    o_ref,  # f32[splits, H/HB, NT * M, L]  rows of tile i: [i * M, (i + 1) * M)
    m_ref, l_ref,  # f32[splits, H/HB, NT * M]
    *, bq: int, hb: int, block_k: int, block_size: int, max_blocks: int, lora: int, rope: int,
    splits: int, scale: float, precision,
):  # fmt: skip
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = bq * hb
    seq, q0, nq, pos0 = tseq_ref[i], tq0_ref[i], tnq_ref[i], tpos_ref[i]

    r = jnp.arange(rows, dtype=jnp.int32)
    tok = r // hb
    row_ok = tok < nq  # [M]
    q_pos = pos0 + tok  # [M]
    q_rows = pl.ds(q0 * hb, rows)
    qn = pltr.load(qn_ref.at[g, q_rows, :], mask=row_ok[:, None], other=0.0)  # [M, L]
    qr = pltr.load(qr_ref.at[g, q_rows, :], mask=row_ok[:, None], other=0.0)  # [M, R]

    ctx = pos0 + nq  # keys [0, ctx)
    cols_l = jnp.arange(lora, dtype=jnp.int32)[None, :]
    cols_r = lora + jnp.arange(rope, dtype=jnp.int32)[None, :]

    def read_block(slot, k_ok):
        slot = slot[:, None]  # [BK, 1]  rows of the cache as [NB * bs, L + R]
        c = pltr.load(
            lat_ref.at[slot, cols_l],
            mask=jnp.broadcast_to(k_ok[:, None], (block_k, lora)),
            other=0.0,
        )  # [BK, L]  fmt: skip
        kr = pltr.load(
            lat_ref.at[slot, cols_r],
            mask=jnp.broadcast_to(k_ok[:, None], (block_k, rope)),
            other=0.0,
        )  # [BK, R]  fmt: skip
        s = mm(qn, c, ((1,), (1,)), precision) + mm(qr, kr, ((1,), (1,)), precision)
        return s * scale, c  # [M, BK]; the latent is the key and the value

    partial = attend_split(
        q_pos, ctx, j, seq, bt_ref, read_block, width=lora, block_k=block_k,
        block_size=block_size, max_blocks=max_blocks, splits=splits, precision=precision,
    )  # fmt: skip
    store_partial(o_ref, m_ref, l_ref, j, g, i, partial, row_ok)


def latent_attention(
    q_abs: jax.Array,  # [T, H, L + R]  absorbed queries, the cache's dtype
    latent_cache: jax.Array,  # [num_blocks, block_size, L + R]
    query_start_loc: jax.Array,  # i32[S+1]
    seq_lens: jax.Array,  # i32[S]  context incl. this step's tokens
    block_tables: jax.Array,  # i32[S, max_blocks]
    num_seqs: jax.Array,  # i32[]
    *,
    lora: int,
    scale: float,
    head_block: int = 16,
    block_k_decode: int = 32,
    block_k_prefill: int | None = None,
    rows_prefill: int = 64,
    target_programs: int = 256,
    max_splits_prefill: int = 2,
    num_warps: int = 4,
    num_stages: int = 2,
    num_warps_prefill: int | None = None,
    num_stages_prefill: int = 2,
    max_q_len: int | None = None,
    skip_rows: jax.Array | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Causal latent attention of a ragged batch. Returns o_lat [T, H, L] (padding 0).

    ``max_q_len``: a static bound on every row's new tokens (``mla_decode`` passes 1); when
    the short tiles hold that many, the long launch is left out. The long launch's tiles
    default to 64-key blocks and 8 warps for 16-bit caches (3.5x faster than 32 keys and 4
    warps on an H100, chunk 4096), 32 and 4 for f32 ones (64 f32 keys of 512 values per
    pipeline stage pass the shared memory). ``skip_rows`` (bool[S]): rows
    another kernel attends (the decompressed prefill); their tokens come back 0."""
    num_tokens, num_heads, width = q_abs.shape
    num_blocks, block_size, _ = latent_cache.shape
    max_blocks = block_tables.shape[1]
    rope = width - lora
    if not (_is_pow2(lora) and _is_pow2(rope)):
        raise ValueError(f"kv_lora_rank={lora} and rope dims={rope} must be powers of two")
    if not _is_pow2(head_block):
        raise ValueError(f"{head_block=} must be a power of two")
    if latent_cache.size >= 2**31:
        raise ValueError(
            f"latent_cache {latent_cache.shape} has {latent_cache.size} >= 2**31 elements: the "
            "Triton kernel's 32-bit offsets would wrap; use fewer blocks per layer"
        )
    hb = min(head_block, next_pow2(num_heads))
    nhb = cdiv(num_heads, hb)
    bq_short = max(1, 16 // hb)
    bq_long = max(bq_short, rows_prefill // hb)
    t_pad = num_tokens + bq_long  # a tile's row window never runs past the array

    # [T, H, L+R] -> [H/HB, Tp * HB, L+R]: the rows of one head block are contiguous.
    qg = jnp.pad(q_abs, ((0, t_pad - num_tokens), (0, nhb * hb - num_heads), (0, 0)))
    qg = qg.reshape(t_pad, nhb, hb, width).transpose(1, 0, 2, 3).reshape(nhb, t_pad * hb, width)
    qn, qr = qg[..., :lora], qg[..., lora:]
    lat = latent_cache.reshape(num_blocks * block_size, width)

    wide = jnp.dtype(latent_cache.dtype).itemsize > 2
    if block_k_prefill is None:
        block_k_prefill = 32 if wide else 64
    if num_warps_prefill is None:
        num_warps_prefill = 4 if wide else 8
    long = Launch(bq_long, block_k_prefill, num_warps_prefill, num_stages_prefill)
    if max_q_len is not None and max_q_len <= bq_short:
        long = None  # every row fits a short tile
    kernel = functools.partial(
        _kernel, hb=hb, block_size=block_size, max_blocks=max_blocks, lora=lora, rope=rope,
        scale=scale, precision=_precision(latent_cache.dtype),
    )  # fmt: skip
    return split_launches(
        kernel, (qn, qr, lat), query_start_loc, seq_lens, block_tables, num_seqs,
        short=Launch(bq_short, block_k_decode, num_warps, num_stages), long=long,
        num_tokens=num_tokens, num_heads=num_heads, groups=nhb, group_rows=hb, group_heads=hb,
        width=lora, groups_fastest=True, block_size=block_size, target_programs=target_programs,
        max_splits_long=max_splits_prefill, skip_rows=skip_rows, interpret=interpret,
        name="mla_latent_attention",
    )  # fmt: skip


_DECOMPRESS_KEYS = {
    "flash_block_q": "block_q", "flash_block_k": "block_k", "flash_warps": "num_warps",
    "flash_stages": "num_stages", "decompress_block_w": "block_w",
    "decompress_block_l": "block_l", "decompress_warps": "num_warps_decompress",
    "decompress_stages": "num_stages_decompress",
}  # fmt: skip


def mla_prefill(
    q: jax.Array,  # [T, H, Dn + R]
    latent_cache: jax.Array,  # [num_blocks, block_size, L + R]  new tokens already written
    w_kv_b: jax.Array,  # [L, H, Dn + Dv]
    query_start_loc: jax.Array,  # i32[S+1]
    seq_lens: jax.Array,  # i32[S]  context incl. this step's tokens
    block_tables: jax.Array,  # i32[S, max_blocks]
    num_seqs: jax.Array,  # i32[]
    *,
    nope_dim: int,
    scale: float,
    decompress_tokens: int | None = None,
    decompress_min_q: int = 256,
    interpret: bool = False,
    **tuning,
) -> jax.Array:
    """``mla_prefill_reference``'s signature and result ([T, H, Dv]), one call for the batch.

    Rows with at least ``decompress_min_q`` new tokens whose contexts fit a transient
    workspace of ``decompress_tokens`` tokens (in row order) run on decompressed keys and
    values (:mod:`pallas_kernels.attention.mla_decompress_gpu`: 3.4x fewer flops per pair at
    Kimi-Linear shapes); the others (decode rows, short chunks, what does not fit) on the
    absorbed latent kernel. The workspace costs ``decompress_tokens * H * (Dn + Dv)`` values
    of the cache's dtype while the call runs (537 MB at 32k tokens, 48B shapes); 0 turns the
    decompressed path off. Defaults, from an H100 (``benchmarks/mla_kernels.py``): 32k tokens
    for 16-bit caches; off for f32 ones (its tiles have not run on a GPU: the interpret-mode
    tests pass a size); ``decompress_min_q`` 256: after 16k cached tokens a 128-token chunk
    took 0.89 ms absorbed and 1.37 ms decompressed, a 256-token one 1.65 and 1.40 (both
    costs grow with the context, so the crossover is about a number of new tokens).
    Tuning keywords: :data:`_DECOMPRESS_KEYS` go to the decompressed path, the rest
    (``head_block``, ``block_k_prefill`` ...) to :func:`latent_attention`."""
    _, lora, rope, dv = check_mla_args(
        q, latent_cache, w_kv_b, nope_dim, query_start_loc, seq_lens, block_tables
    )
    dec_tuning = {_DECOMPRESS_KEYS[k]: tuning.pop(k) for k in list(tuning) if k in _DECOMPRESS_KEYS}
    num_tokens = q.shape[0]
    num_rows, max_blocks = block_tables.shape
    min_q = max(2, decompress_min_q)
    if decompress_tokens is None:
        decompress_tokens = 32768 if jnp.dtype(latent_cache.dtype).itemsize <= 2 else 0
    workspace = 0
    if all(_is_pow2(d) for d in (nope_dim, rope, dv, lora)):
        workspace = workspace_tokens(
            num_tokens, num_rows, max_blocks * latent_cache.shape[1],
            decompress_tokens=decompress_tokens, min_q=min_q,
        )  # fmt: skip
    chosen = None
    if workspace > 0:
        qsl = query_start_loc.astype(jnp.int32)
        live_row = jnp.arange(num_rows) < jnp.asarray(num_seqs, jnp.int32)
        chosen, ws_end = choose_rows(
            qsl[1:] - qsl[:-1], seq_lens.astype(jnp.int32), live_row, workspace=workspace,
            min_q=min_q,
        )  # fmt: skip
    q_abs = absorb_query(q, w_kv_b, nope_dim=nope_dim, dtype=latent_cache.dtype)
    o_lat = latent_attention(
        q_abs, latent_cache, query_start_loc, seq_lens, block_tables, num_seqs,
        lora=lora, scale=scale, skip_rows=chosen, interpret=interpret, **tuning,
    )  # fmt: skip
    # o_lat in the cache's dtype: a bf16 model's output projection runs on tensor cores
    out = absorb_output(o_lat.astype(latent_cache.dtype), w_kv_b, nope_dim=nope_dim, dtype=q.dtype)
    if chosen is None:
        return out
    o_dec = decompressed_attention(
        q, latent_cache, w_kv_b, query_start_loc, seq_lens, block_tables, chosen, ws_end,
        nope_dim=nope_dim, scale=scale, workspace=workspace,
        max_rows=min(num_rows, num_tokens // min_q), interpret=interpret, **dec_tuning,
    )  # fmt: skip
    seq_id, _, live = token_rows(query_start_loc.astype(jnp.int32), num_seqs, num_tokens)
    mine = (chosen[seq_id] & live)[:, None, None]
    return jnp.where(mine, o_dec.astype(q.dtype), out)


def mla_decode(*args, interpret: bool = False, **kwargs) -> jax.Array:
    """``mla_decode_reference``'s signature and result ([S, H, Dv]) on the GPU kernel: the
    absorbed kernel's short launch alone (the decompressed prefill's keywords are ignored, so
    one tuning dict serves both ops)."""
    tuning = {k: kwargs.pop(k) for k in list(kwargs) if k not in ("nope_dim", "scale")}
    for k in (*_DECOMPRESS_KEYS, "decompress_tokens", "decompress_min_q"):
        tuning.pop(k, None)
    return absorbed_decode(latent_attention, interpret=interpret, **tuning)(*args, **kwargs)
