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


MAX_LOGPROBS = 20  # top logprobs a request may ask for (OpenAI's chat limit)


def token_logprobs(
    logits: jax.Array,  # f32[S, V]  raw model logits (before temperature and filters)
    tokens: jax.Array,  # i32[S]
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probabilities of the model's distribution, as vLLM reports them by default.

    Returns the sampled token's logprob f32[S] and the ``MAX_LOGPROBS`` most likely tokens
    (i32[S, K], f32[S, K]), best first.
    """
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    k = min(MAX_LOGPROBS, logits.shape[-1])
    top_lp, top_ids = jax.lax.top_k(lp, k)
    return chosen, top_ids.astype(jnp.int32), top_lp
