"""Multi-head latent attention (MLA, NoPE as in Kimi-Linear) on a paged *latent* cache.

One MLA layer caches, per token, only its compressed latent: the normalised ``c_kv``
(``kv_lora_rank`` = L values) followed by the shared ``k_rope`` (R values), one vector for
all heads::

    latent_cache: [num_blocks, block_size, L + R]         block 0 is the null block
    token row:    | c_kv (L) ........................ | k_rope (R) |

Keys and values are ``kv_b_proj`` images of ``c_kv``, with ``w_kv_b: [L, H, Dn + Dv]``::

    k[h] = [ c_kv @ w_kv_b[:, h, :Dn] | k_rope ]            (Dn + R)
    v[h] =   c_kv @ w_kv_b[:, h, Dn:]                        (Dv)

Prefill decompresses the context's keys and values (one matmul per context token, shared by
every query token of the chunk). Decode *absorbs* the weights instead, so the context is
read in latent form and nothing of size ``ctx x H`` is built::

    q_lat[h] = w_kv_b[:, h, :Dn] @ q_nope[h]                 (L)
    score[h, c] = q_lat[h] . c_kv[c] + q_rope[h] . k_rope[c]
    o[h] = (softmax(score[h]) @ c_kv) @ w_kv_b[:, h, Dn:]     (Dv)

Both are the same function of the cache; the tests check each against a float64 oracle.
Cost note: this prefill materialises every row's decompressed context at once
(``S x ctx x H x (Dn + Dv)`` floats), fine for tests and small batches, too much for
Kimi-Linear-48B with hundreds of rows and long contexts. The Pallas kernels
(``mla_tpu.py``, ``mla_gpu.py``, around ``mla_absorb.py``) absorb on every row instead and
read the context only as latents; on NVIDIA long prefill rows decompress their gathered
context into a per-call workspace instead (``mla_decompress_gpu.py``), never into the cache.
Positions past a sequence's length may hold anything (NaN in tests): they are zeroed before
they meet a matmul, never only masked out of the softmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common.ragged import set_rows, token_seq_ids

EXACT = jax.lax.Precision.HIGHEST  # IEEE f32 on every platform (no TF32 on GPU)


def write_latent_reference(
    latent: jax.Array,  # [T, L + R]
    latent_cache: jax.Array,  # [num_blocks, block_size, L + R]
    slot_mapping: jax.Array,  # i32[T]  block_id * block_size + offset; padding -> null block
) -> jax.Array:
    """Scatters the new tokens' latents into the paged cache. Returns the updated cache."""
    if latent.shape[-1] != latent_cache.shape[-1]:
        raise ValueError(
            f"latent {latent.shape} and latent_cache {latent_cache.shape} widths differ"
        )
    nb, bs, width = latent_cache.shape
    flat = set_rows(latent_cache.reshape(nb * bs, width), slot_mapping, latent)
    return flat.reshape(nb, bs, width)


def check_mla_args(
    q, latent_cache, w_kv_b, nope_dim, query_start_loc=None, seq_lens=None, block_tables=None
) -> tuple[int, int, int, int]:
    """Returns ``(H, L, R, Dv)``; raises with the bad argument's name. The batch's arrays
    (``query_start_loc``, ``seq_lens``, ``block_tables``) are checked where given."""
    _, h, qk = q.shape
    width = latent_cache.shape[-1]
    if w_kv_b.ndim != 3 or w_kv_b.shape[1] != h or w_kv_b.shape[2] <= nope_dim:
        raise ValueError(f"w_kv_b {w_kv_b.shape} must be [L, H={h}, {nope_dim=} + Dv]")
    lora = w_kv_b.shape[0]
    rope = qk - nope_dim
    if rope < 0 or width != lora + rope:
        raise ValueError(
            f"latent_cache width {width} must be kv_lora_rank {lora} + rope dims {rope} "
            f"(q head dim {qk} - {nope_dim=})"
        )
    if block_tables is not None:
        rows = block_tables.shape[0]
        if block_tables.ndim != 2:
            raise ValueError(f"block_tables {block_tables.shape} must be [S, max_blocks]")
        if seq_lens.shape != (rows,):
            raise ValueError(f"seq_lens {seq_lens.shape} must be [S={rows}] like block_tables")
        if query_start_loc.shape != (rows + 1,):
            raise ValueError(f"query_start_loc {query_start_loc.shape} must be [S+1 = {rows + 1}]")
    return h, lora, rope, w_kv_b.shape[2] - nope_dim


def _context(latent_cache, block_tables, rows, length):
    """The latents of ``rows``' first ``length`` positions: f32[N, ctx, L + R], rest zero."""
    nb, bs, width = latent_cache.shape
    ctx = block_tables.shape[1] * bs
    lat = latent_cache[block_tables[rows]].reshape(rows.shape[0], ctx, width)
    valid = jnp.arange(ctx)[None, :] < length[:, None]  # [N, ctx]
    return jnp.where(valid[..., None], lat.astype(jnp.float32), 0.0), valid


def mla_prefill_reference(
    q: jax.Array,  # [T, H, Dn + R]  per head: q_nope | q_rope
    latent_cache: jax.Array,  # [num_blocks, block_size, L + R]  new tokens already written
    w_kv_b: jax.Array,  # [L, H, Dn + Dv]
    query_start_loc: jax.Array,  # i32[S+1]
    seq_lens: jax.Array,  # i32[S]  context incl. this step's tokens
    block_tables: jax.Array,  # i32[S, max_blocks]
    num_seqs: jax.Array,  # i32[]
    *,
    nope_dim: int,
    scale: float,
) -> jax.Array:
    """Causal MLA of every query token over its sequence, decompressed. Returns [T, H, Dv]."""
    num_tokens = q.shape[0]
    num_rows = block_tables.shape[0]
    _, lora, _, _ = check_mla_args(q, latent_cache, w_kv_b, nope_dim)
    w = w_kv_b.astype(jnp.float32)
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    lat, _ = _context(latent_cache, block_tables, rows, seq_lens)  # [S, ctx, L+R]
    # Decompress every row's context once: k_nope [S, ctx, H, Dn], v [S, ctx, H, Dv].
    kv = jnp.einsum("SCL,LHE->SCHE", lat[..., :lora], w, precision=EXACT)
    k_nope, v = kv[..., :nope_dim], kv[..., nope_dim:]
    k_rope = lat[..., lora:]  # [S, ctx, R] shared by the heads

    seq_id, local, live = token_seq_ids(query_start_loc, num_seqs, num_tokens)
    q_len = query_start_loc[1:] - query_start_loc[:-1]
    pos = seq_lens[seq_id] - q_len[seq_id] + local  # [T]
    q32 = q.astype(jnp.float32)
    ctx = lat.shape[1]

    def one_token(args):
        qt, s, p = args  # [H, Dn+R], [], []
        scores = jnp.einsum("HN,CHN->HC", qt[:, :nope_dim], k_nope[s], precision=EXACT)
        scores += jnp.einsum("HR,CR->HC", qt[:, nope_dim:], k_rope[s], precision=EXACT)
        scores = jnp.where(jnp.arange(ctx)[None, :] <= p, scores * scale, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        return jnp.einsum("HC,CHV->HV", probs, v[s], precision=EXACT)

    out = jax.lax.map(one_token, (q32, seq_id, pos), batch_size=min(16, num_tokens))
    return jnp.where(live[:, None, None], out, 0.0).astype(q.dtype)


def mla_decode_reference(
    q: jax.Array,  # [S, H, Dn + R]  one new token per sequence, its latent already written
    latent_cache: jax.Array,  # [num_blocks, block_size, L + R]
    w_kv_b: jax.Array,  # [L, H, Dn + Dv]
    seq_lens: jax.Array,  # i32[S]  context incl. the new token
    block_tables: jax.Array,  # i32[S, max_blocks]
    num_seqs: jax.Array,  # i32[]
    *,
    nope_dim: int,
    scale: float,
) -> jax.Array:
    """MLA decode with absorbed weights, reading the context as latents. Returns [S, H, Dv]."""
    num_rows = q.shape[0]
    if block_tables.shape[0] != num_rows:
        raise ValueError(f"block_tables {block_tables.shape} must have one row per query {q.shape}")
    _, lora, _, _ = check_mla_args(q, latent_cache, w_kv_b, nope_dim)
    w = w_kv_b.astype(jnp.float32)
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    lat, valid = _context(latent_cache, block_tables, rows, seq_lens)  # [S, ctx, L+R]
    q32 = q.astype(jnp.float32)
    # Absorb W_k into the query: [S, H, L].
    q_lat = jnp.einsum("SHN,LHN->SHL", q32[..., :nope_dim], w[..., :nope_dim], precision=EXACT)
    scores = jnp.einsum("SHL,SCL->SHC", q_lat, lat[..., :lora], precision=EXACT)
    scores += jnp.einsum("SHR,SCR->SHC", q32[..., nope_dim:], lat[..., lora:], precision=EXACT)
    scores = jnp.where(valid[:, None, :], scores * scale, -jnp.inf)
    live = rows < num_seqs
    # A padding row has no valid position: give it one so the softmax stays finite.
    scores = jnp.where(live[:, None, None], scores, 0.0)
    probs = jax.nn.softmax(scores, axis=-1)
    o_lat = jnp.einsum("SHC,SCL->SHL", probs, lat[..., :lora], precision=EXACT)
    # Absorb W_v on the way out: [S, H, Dv].
    out = jnp.einsum("SHL,LHV->SHV", o_lat, w[..., nope_dim:], precision=EXACT)
    return jnp.where(live[:, None, None], out, 0.0).astype(q.dtype)
