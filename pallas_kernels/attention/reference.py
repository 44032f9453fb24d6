"""Ragged paged attention and the paged KV write (pure JAX, float32 softmax).

The KV cache of one layer is ``k_cache, v_cache: [num_blocks, block_size, Hkv, D]``; block 0
is the null block. Sequence ``s`` owns the blocks ``block_tables[s, :]``; its token at position
``p`` lives in block ``block_tables[s, p // block_size]`` at offset ``p % block_size``::

    block_tables[s] = [7, 3, 0, 0]        block_size = 4, seq_lens[s] = 6
    positions:        0 1 2 3 | 4 5 . .
    blocks:              7    |    3      (the trailing 0s are never read unmasked)

New tokens are written first (:func:`write_kv_reference`), then every query token attends to
the positions ``<= its own`` of its sequence (causal within the new tokens, GQA).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common.ragged import token_seq_ids


def write_kv_reference(
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    k_cache: jax.Array,  # [num_blocks, block_size, Hkv, D]
    v_cache: jax.Array,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: jax.Array,  # i32[T]  block_id * block_size + offset; padding -> null block
) -> tuple[jax.Array, jax.Array]:
    """Scatters the new tokens' K/V into the paged cache. Returns the updated caches.

    Indexed by (block, offset), not through a flattened view: under ``shard_map`` with one KV
    head per device, XLA copied the whole (donated) pool around a reshape-scatter-reshape on
    every step (``tests/serving/test_tensor_parallel.py`` checks the compiled step for it).
    """
    bs = k_cache.shape[1]
    block, offset = slot_mapping // bs, slot_mapping % bs
    k_cache = k_cache.at[block, offset].set(k.astype(k_cache.dtype))
    v_cache = v_cache.at[block, offset].set(v.astype(v_cache.dtype))
    return k_cache, v_cache


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,  # [num_blocks, block_size, Hkv, D]
    v_cache: jax.Array,  # [num_blocks, block_size, Hkv, D]
    query_start_loc: jax.Array,  # i32[S+1]
    seq_lens: jax.Array,  # i32[S]  context incl. this step's tokens
    block_tables: jax.Array,  # i32[S, max_blocks]
    num_seqs: jax.Array,  # i32[]
    *,
    scale: float,
) -> jax.Array:
    """Causal attention of every query token over its sequence's paged KV. Returns [T, Hq, D]."""
    check_attention_args(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    max_ctx = block_tables.shape[1] * block_size
    seq_id, local, live = token_seq_ids(query_start_loc, num_seqs, num_tokens)
    q_len = query_start_loc[1:] - query_start_loc[:-1]
    pos = seq_lens[seq_id] - q_len[seq_id] + local  # [T]

    def one_token(args):
        qt, s, p = args  # [Hq, D], [], []
        blocks = block_tables[s]  # [max_blocks]
        kt = k_cache[blocks].reshape(max_ctx, num_kv_heads, head_dim).astype(jnp.float32)
        vt = v_cache[blocks].reshape(max_ctx, num_kv_heads, head_dim).astype(jnp.float32)
        valid = jnp.arange(max_ctx) <= p  # [ctx]
        vt = jnp.where(valid[:, None, None], vt, 0.0)  # unused pages may hold NaN
        qg = qt.astype(jnp.float32).reshape(num_kv_heads, group, head_dim)
        scores = jnp.einsum("KGD,CKD->KGC", qg, kt) * scale
        scores = jnp.where(valid[None, None, :], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("KGC,CKD->KGD", probs, vt)
        return out.reshape(num_q_heads, head_dim)

    out = jax.lax.map(one_token, (q, seq_id, pos), batch_size=min(16, num_tokens))
    return jnp.where(live[:, None, None], out, 0.0).astype(q.dtype)


def check_attention_args(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables) -> None:
    """Raises ``ValueError`` naming the first inconsistent shape (shared by every backend)."""
    if q.ndim != 3:
        raise ValueError(f"q {q.shape} must be [T, Hq, D]")
    num_q_heads, head_dim = q.shape[1:]
    if k_cache.ndim != 4 or k_cache.shape[-1] != head_dim:
        raise ValueError(
            f"k_cache {k_cache.shape} must be [num_blocks, block_size, Hkv, {head_dim}]"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache {v_cache.shape} must match k_cache {k_cache.shape}")
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads=} must be divisible by {num_kv_heads=}")
    rows = seq_lens.shape[0]
    if seq_lens.ndim != 1 or query_start_loc.shape != (rows + 1,):
        raise ValueError(f"query_start_loc {query_start_loc.shape} must be [S+1], S = {rows}")
    if block_tables.ndim != 2 or block_tables.shape[0] != rows:
        raise ValueError(f"block_tables {block_tables.shape} must be [S={rows}, max_blocks]")
