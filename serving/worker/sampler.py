"""Sampling on device: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Each row draws from ``key(seed)`` folded with the position of the token it generates, so a
request's samples do not depend on which other requests share its steps.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from serving.core.plan import SamplingArrays

# A pytree, so that a jitted function takes the rows' parameters whole.
jax.tree_util.register_dataclass(SamplingArrays)


def sample(
    logits: jax.Array,  # f32[S, V]
    sampling: SamplingArrays,  # [S] each, as jax arrays
    positions: jax.Array,  # i32[S]  position of the token being generated
    *,
    gather: Callable[[jax.Array], jax.Array] = lambda x: x,
) -> jax.Array:
    """Returns i32[S] token ids.

    Only what some row asks for runs (``lax.cond`` on the batch): an all-greedy step is one
    argmax; the full-vocabulary sort that top-k / top-p read their thresholds from runs only
    when a sampled row sets one of them (on a GPU a segmented sort of every [S, V] step).

    ``gather`` makes the logits whole on every device before the sort (tensor parallel leaves
    them split by vocab: a partitioned sort and cumsum are all-to-alls and a while loop). The
    rest (argmax, max, the Gumbel draw) runs on the split logits, as XLA partitions them with
    a few scalars per row crossing devices instead of the [S, V] logits (on two H100s that
    gather was 1.2 ms of a 64-row decode step).
    """
    temperature, top_p, min_p = sampling.temperature, sampling.top_p, sampling.min_p
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    vocab = logits.shape[-1]
    sampled_rows = temperature > 0
    top_k = sampling.top_k
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    needs_sort = jnp.any(sampled_rows & ((k < vocab) | (top_p < 1)))

    def draw_all():
        t = jnp.where(sampled_rows, temperature, 1.0)[:, None]
        scaled = logits / t
        top = jnp.max(scaled, axis=-1, keepdims=True)
        # min-p: drop tokens below min_p times the top probability.
        mth = top + jnp.log(jnp.maximum(min_p[:, None], 1e-30))
        mth = jnp.where(min_p[:, None] > 0, mth, -jnp.inf)
        threshold = jax.lax.cond(
            needs_sort,
            lambda: jnp.maximum(_sorted_threshold(gather(scaled), k, top_p), mth),
            lambda: mth,
        )
        masked = jnp.where(scaled >= threshold, scaled, -jnp.inf)

        def draw(seed, pos, row):
            key = jax.random.fold_in(jax.random.key(seed), pos)
            return jax.random.categorical(key, row).astype(jnp.int32)

        return jnp.where(sampled_rows, jax.vmap(draw)(sampling.seeds, positions, masked), greedy)

    return jax.lax.cond(jnp.any(sampled_rows), draw_all, lambda: greedy)


def _sorted_threshold(scaled: jax.Array, k: jax.Array, top_p: jax.Array) -> jax.Array:
    """f32[S, 1]: the lowest logit top-k (``k``) and top-p keep, read off one sorted row."""
    sorted_logits = -jnp.sort(-scaled, axis=-1)  # [S, V]
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    # top-p: keep the smallest prefix whose mass reaches p (the first token always stays).
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = mass_before < top_p[:, None]
    n_keep = jnp.maximum(jnp.sum(keep_sorted, axis=-1), 1)
    pth = jnp.take_along_axis(sorted_logits, (n_keep - 1)[:, None], axis=-1)
    # top_p = 1 is off: no threshold from a cumsum that may round to 1 before the tail.
    pth = jnp.where(top_p[:, None] < 1, pth, -jnp.inf)
    return jnp.maximum(kth, pth)


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
