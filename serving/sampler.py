"""Sampling on device: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Each row draws from ``key(seed)`` folded with the position of the token it generates, so a
request's samples do not depend on which other requests share its steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample(
    logits: jax.Array,  # f32[S, V]
    temperature: jax.Array,  # f32[S]  0 = greedy
    top_p: jax.Array,  # f32[S]  1 = off
    top_k: jax.Array,  # i32[S]  0 = off
    min_p: jax.Array,  # f32[S]  0 = off
    seeds: jax.Array,  # u32[S]
    positions: jax.Array,  # i32[S]  position of the token being generated
) -> jax.Array:
    """Returns i32[S] token ids."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    vocab = logits.shape[-1]
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    scaled = logits / t
    # One descending sort serves top-k and top-p: thresholds are read off the sorted row.
    sorted_logits = -jnp.sort(-scaled, axis=-1)  # [S, V]
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)  # [S, 1]
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    # top-p: keep the smallest prefix whose mass reaches p (the first token always stays).
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = mass_before < top_p[:, None]
    n_keep = jnp.maximum(jnp.sum(keep_sorted, axis=-1), 1)
    pth = jnp.take_along_axis(sorted_logits, (n_keep - 1)[:, None], axis=-1)
    # min-p: drop tokens below min_p times the top probability.
    mth = sorted_logits[:, :1] + jnp.log(jnp.maximum(min_p[:, None], 1e-30))
    mth = jnp.where(min_p[:, None] > 0, mth, -jnp.inf)
    threshold = jnp.maximum(jnp.maximum(kth, pth), mth)
    masked = jnp.where(scaled >= threshold, scaled, -jnp.inf)

    def draw(seed, pos, row):
        key = jax.random.fold_in(jax.random.key(seed), pos)
        return jax.random.categorical(key, row).astype(jnp.int32)

    sampled = jax.vmap(draw)(seeds, positions, masked)
    return jnp.where(temperature > 0, sampled, greedy)
