"""Query tiles of a ragged batch, for the attention kernels (jnp, traced in their wrappers).

Loop-free on purpose: ``jnp.searchsorted``'s default method is a ``while`` loop, and every trip
of an XLA while loop on GPU costs a host round trip (about 10 us each; a few of them dominated
decode steps at batch 8-64 on an H200).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cdiv(a, b):
    return (a + b - 1) // b


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def split_count(programs: int, kv_blocks: int, target_programs: int) -> int:
    """KV splits per (tile, head group) so a launch has about ``target_programs`` programs:
    a power of two, at most one split per KV block."""
    want = next_pow2(cdiv(target_programs, max(1, programs)))
    return max(1, min(want, next_pow2(kv_blocks)))


def normalise_split(o: jax.Array, l: jax.Array) -> jax.Array:
    """One split: ``o / l`` (rows that saw no key, l = 0, stay 0)."""
    return o / jnp.where(l > 0, l, 1.0)[..., None]


def merge_splits(
    o: jax.Array,  # f32[splits, ..., D]  unnormalised partial outputs
    m: jax.Array,  # f32[splits, ...]  running max of each partial
    l: jax.Array,  # f32[splits, ...]  softmax denominators (0: the split saw no key)
) -> jax.Array:
    """Log-sum-exp merge of flash-decoding partials, normalised. Returns f32[..., D]."""
    w = jnp.exp(m - jnp.max(m, axis=0)[None])  # [splits, ...]
    den = jnp.sum(w * l, axis=0)
    return jnp.sum(w[..., None] * o, axis=0) / jnp.where(den > 0, den, 1.0)[..., None]


def count_le(bounds: jax.Array, x: jax.Array) -> jax.Array:
    """``searchsorted(bounds, x, side="right")`` as one compare-and-sum (no loop)."""
    return jnp.sum(bounds[None, :] <= x[:, None], axis=1, dtype=jnp.int32)


def token_rows(query_start_loc: jax.Array, num_seqs: jax.Array, num_tokens: int):
    """``(seq_id, local, live)`` of every token, as ``common.ragged.token_seq_ids``, loop-free."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_id = jnp.minimum(count_le(query_start_loc[1:], t), query_start_loc.shape[0] - 2)
    return seq_id, t - query_start_loc[seq_id], t < query_start_loc[num_seqs]


def work_list(
    q_len: jax.Array,  # i32[S]
    seq_lens: jax.Array,  # i32[S]
    query_start_loc: jax.Array,  # i32[S+1]
    live_row: jax.Array,  # bool[S]  the rows this list covers
    *,
    bq: int,
    capacity: int,
) -> tuple[list[jax.Array], jax.Array]:
    """Tiles of ``bq`` tokens over the rows ``live_row`` selects (e.g. only decode rows).

    Returns i32[capacity] arrays ``(seq, first token, tokens in tile, first position)`` (tiles
    past the last one have 0 tokens: their programs do nothing) and i32[S] ``first_tile``::

        q_len = [1, 40, 1, 9], long rows, bq = 8:  tiles 0..4 -> seq 1 (tokens 0, 8, .. 32)
                                                   tiles 5..6 -> seq 3 (tokens 0, 8)
                                                   first_tile = [?, 0, ?, 5]
    """
    num_rows = q_len.shape[0]
    n_tiles = jnp.where(live_row, cdiv(q_len, bq), 0)
    ends = jnp.cumsum(n_tiles)  # [S]
    t = jnp.arange(capacity, dtype=jnp.int32)
    seq = jnp.minimum(count_le(ends, t), num_rows - 1)
    first_tile = ends - n_tiles
    local = (t - first_tile[seq]) * bq
    valid = t < ends[-1]
    first = query_start_loc[seq] + local
    nq = jnp.where(valid, jnp.minimum(bq, q_len[seq] - local), 0)
    pos0 = jnp.where(valid, seq_lens[seq] - q_len[seq] + local, 0)
    tiles = [x.astype(jnp.int32) for x in (seq, first, nq, pos0)]
    return tiles, first_tile.astype(jnp.int32)
