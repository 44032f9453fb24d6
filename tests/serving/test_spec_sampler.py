"""The verify step's sampler (``serving/worker/spec_decode.py``) on its own: greedy acceptance,
rows without drafts equal to the plain sampler bit for bit, and rejection sampling's output
distribution equal to the target's (chi-square over many seeds, fixed, on a 6-token vocab)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from serving.core.plan import SamplingArrays
from serving.worker.sampler import sample
from serving.worker.spec_decode import verify_sample


def _sampling(n, temperature, seeds=None, **kw):
    s = SamplingArrays.empty(n)
    s.temperature[:] = temperature
    if seeds is not None:
        s.seeds[:] = seeds
    for k, v in kw.items():
        getattr(s, k)[:] = v
    return jax.tree.map(jnp.asarray, s)


def test_greedy_acceptance_and_the_bonus_token():
    k = 3
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2 * (k + 1), 10)).astype(np.float32)
    target = logits.argmax(-1).reshape(2, k + 1)
    drafts = np.array([[target[0, 0], target[0, 1], (target[0, 2] + 1) % 10],
                       [target[1, 0], target[1, 1], target[1, 2]]], np.int32)  # fmt: skip
    out = verify_sample(
        jnp.asarray(logits), _sampling(2, 0.0), jnp.array([20, 30]), jnp.asarray(drafts),
        jnp.array([3, 3]),
    )  # fmt: skip
    assert (
        out.tolist()
        == [
            [target[0, 0], target[0, 1], target[0, 2], -1],  # d3 rejected: the target's token
            [*target[1, :3], target[1, 3]],  # all accepted: the bonus token
        ]
    )
    # fewer drafts than K: the row's logits past them repeat its last token's
    out = verify_sample(
        jnp.asarray(logits), _sampling(2, 0.0), jnp.array([20, 30]), jnp.asarray(drafts),
        jnp.array([1, 0]),
    )  # fmt: skip
    assert out.tolist() == [[target[0, 0], target[0, 1], -1, -1], [target[1, 0], -1, -1, -1]]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_rows_without_drafts_sample_as_the_plain_sampler(temperature):
    k, s, v = 2, 8, 50
    rng = np.random.default_rng(1)
    row_logits = rng.normal(size=(s, v)).astype(np.float32)
    logits = np.repeat(row_logits, k + 1, axis=0)  # no drafts: the last token's logits repeated
    sampling = _sampling(s, temperature, seeds=np.arange(s) + 5, top_k=20, top_p=0.9)
    pos = jnp.arange(s, dtype=jnp.int32) + 40
    out = verify_sample(
        jnp.asarray(logits), sampling, pos, jnp.zeros((s, k), jnp.int32), jnp.zeros(s, jnp.int32)
    )
    plain = sample(jnp.asarray(row_logits), sampling, pos)
    assert out[:, 0].tolist() == plain.tolist()
    assert (out[:, 1:] == -1).all()


def test_rejection_sampling_keeps_the_target_distribution():
    """Two drafts per row over N seeds: the first new token is distributed as p0 (the draft
    accepted with p0(d1), else the residual), and, where d1 was accepted, the second as p1."""
    v, k, n = 6, 2, 20_000
    p0 = np.array([0.05, 0.4, 0.1, 0.2, 0.15, 0.1])
    p1 = np.array([0.3, 0.02, 0.08, 0.1, 0.2, 0.3])
    p2 = np.full(v, 1 / v)
    temperature = 0.7
    one = np.log(np.stack([p0, p1, p2])) * temperature  # scaled by 1/T in the sampler
    logits = np.tile(one, (n, 1)).astype(np.float32)  # [n * (k + 1), v]
    drafts = np.tile(np.array([[1, 5]], np.int32), (n, 1))
    out = jax.jit(verify_sample)(
        jnp.asarray(logits),
        _sampling(n, temperature, seeds=np.arange(n, dtype=np.uint32)),
        jnp.full(n, 100, jnp.int32),
        jnp.asarray(drafts),
        jnp.full(n, k, jnp.int32),
    )
    out = np.asarray(out)
    first = np.bincount(out[:, 0], minlength=v)
    assert stats.chisquare(first, p0 * n).pvalue > 1e-4
    accepted = out[:, 0] == 1
    assert abs(accepted.mean() - p0[1]) < 0.02
    second = np.bincount(out[accepted, 1], minlength=v)
    assert stats.chisquare(second, p1 * accepted.sum()).pvalue > 1e-4
    # rows that rejected d1 stop there
    assert (out[~accepted, 1] == -1).all()
    # the same seeds give the same tokens
    again = jax.jit(verify_sample)(
        jnp.asarray(logits),
        _sampling(n, temperature, seeds=np.arange(n, dtype=np.uint32)),
        jnp.full(n, 100, jnp.int32),
        jnp.asarray(drafts),
        jnp.full(n, k, jnp.int32),
    )
    assert (np.asarray(again) == out).all()
