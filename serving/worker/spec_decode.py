"""Speculative decoding on device: the target's tokens at every position of a verify row, and
which drafts they accept (``serving/core/speculative.py`` has the host side).

A step with verify rows (``StepShape.num_spec`` = K > 0) has logits at K + 1 positions of
every row (``build_plan``'s ``logits_indices``). Position ``j`` of a row samples the token at
sequence position ``p_j = seq_len - num_drafts + j`` exactly as the plain sampler would there
(same processors, same key ``fold_in(key(seed), p_j)``): a row without drafts gets the plain
step's token bit for bit.

Acceptance of draft ``d = d_{j+1}`` against position ``j``'s distribution ``p`` (after
temperature, top-k, top-p, min-p):

- greedy rows: accepted iff ``d == argmax p``;
- sampled rows (rejection sampling for a deterministic drafter, whose proposal is one-hot):
  accepted with probability ``p(d)``; on rejection the token is drawn from ``p`` with ``d``
  removed and renormalised. Then the token at each position is distributed as ``p``:
  ``P(d) = p(d)`` and ``P(x) = (1 - p(d)) * p(x) / (1 - p(d)) = p(x)`` for ``x != d``.

The row yields the accepted drafts ``d_1 .. d_a`` and one more token: the rejection's draw at
``a`` (greedy: the argmax), or the plain sample at ``a`` when every draft was accepted.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from serving.core.plan import SamplingArrays
from serving.worker import branches
from serving.worker.sampler import TokenTables, filtered_logits, sample


def accept_drafts(
    filtered: jax.Array,  # f32[S, K, V]  position j's filtered logits (``filtered_logits``)
    drafts: jax.Array,  # i32[S, K]
    keys: jax.Array,  # key[S, K]  position j's key (fold_in(key(seed), p_j))
) -> tuple[jax.Array, jax.Array]:
    """Rejection sampling of one-hot proposals: ``(accepted bool[S, K], residual i32[S, K])``,
    draft ``j`` accepted with probability ``p_j(d)``, else the residual draw from ``p_j``
    without ``d``."""
    logp = jax.nn.log_softmax(filtered, axis=-1)
    p_d = jnp.exp(jnp.take_along_axis(logp, drafts[..., None], axis=-1)[..., 0])  # [S, K]
    split = jax.vmap(jax.vmap(lambda k: (jax.random.fold_in(k, 1), jax.random.fold_in(k, 2))))
    k_accept, k_resid = split(keys)
    u = jax.vmap(jax.vmap(lambda k: jax.random.uniform(k)))(k_accept)
    without = jnp.where(jnp.arange(filtered.shape[-1]) == drafts[..., None], -jnp.inf, filtered)
    resid = jax.vmap(jax.vmap(jax.random.categorical))(k_resid, without).astype(jnp.int32)
    return u < p_d, resid


def verify_sample(
    logits: jax.Array,  # f32[S * (K + 1), V]
    sampling: SamplingArrays,  # [S] each
    seq_lens: jax.Array,  # i32[S]
    draft_ids: jax.Array,  # i32[S, K]
    num_drafts: jax.Array,  # i32[S]
    *,
    gather: Callable[[jax.Array], jax.Array] = lambda x: x,
    tables: TokenTables | None = None,
) -> jax.Array:
    """i32[S, K + 1]: each row's new tokens (accepted drafts, then the target's token), -1
    after them. A row without drafts yields one token, the plain sampler's."""
    s, k = draft_ids.shape
    n = k + 1
    j = jnp.arange(n, dtype=jnp.int32)
    pos = seq_lens[:, None] - num_drafts[:, None] + j[None, :]  # [S, K+1] positions generated
    per_pos = jax.tree.map(lambda x: jnp.repeat(x, n, axis=0), sampling)  # [S * (K+1)] each
    target = sample(logits, per_pos, pos.reshape(-1), gather=gather, tables=tables)
    target = target.reshape(s, n)  # the plain sampler's token at every position
    has = j[None, :k] < num_drafts[:, None]  # [S, K]
    greedy_ok = draft_ids == target[:, :k]
    sampled_rows = sampling.temperature > 0

    def rejection():
        filt = filtered_logits(logits, per_pos, gather).reshape(s, n, -1)[:, :k]
        keys = jax.vmap(jax.vmap(lambda seed, p: jax.random.fold_in(jax.random.key(seed), p)))(
            jnp.broadcast_to(sampling.seeds[:, None], (s, k)), pos[:, :k]
        )
        ok, resid = accept_drafts(filt, draft_ids, keys)
        ok = jnp.where(sampled_rows[:, None], ok, greedy_ok)
        return ok, jnp.where(sampled_rows[:, None], resid, target[:, :k])

    if k:
        ok, resid = branches.cond(
            jnp.any(sampled_rows & (num_drafts > 0)),
            rejection,
            lambda: (greedy_ok, target[:, :k]),
        )
    else:
        ok, resid = greedy_ok, target[:, :k]
    accepted = jnp.sum(jnp.cumprod(ok & has, axis=1), axis=1)  # [S]
    pad = jnp.zeros((s, 1), jnp.int32)
    resid_a = jnp.take_along_axis(jnp.concatenate([resid, pad], 1), accepted[:, None], 1)[:, 0]
    target_a = jnp.take_along_axis(target, accepted[:, None], 1)[:, 0]
    last = jnp.where(accepted < num_drafts, resid_a, target_a)  # [S]
    drafts = jnp.concatenate([draft_ids, pad], 1)  # [S, K+1]
    a = accepted[:, None]
    return jnp.where(j < a, drafts, jnp.where(j == a, last[:, None], -1)).astype(jnp.int32)
