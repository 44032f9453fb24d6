"""On-device sampling: each filter keeps exactly the tokens it should, seeds reproduce."""

import jax
import jax.numpy as jnp
import numpy as np

from serving.core.plan import SamplingArrays
from serving.worker.sampler import (
    MAX_LOGPROBS,
    _searched_threshold,
    _sorted_threshold,
    blocked_top_k,
    sample,
    token_logprobs,
)

V = 32


def _rows(n: int, **values) -> SamplingArrays:
    """``n`` rows: padding (sampling off) but for the given fields, a value or one per row."""
    rows = SamplingArrays.empty(n)
    for name, v in values.items():
        getattr(rows, name)[:] = v
    return rows


def _draws(logits, n=400, **kw):
    """n draws of one row (distinct positions give independent keys)."""
    s = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, V))
    rows = _rows(n, **{"temperature": 1.0, "seeds": 3, **kw})
    return np.asarray(jax.jit(sample)(s, rows, jnp.arange(n, dtype=jnp.int32)))


LOGITS = np.linspace(2.0, -2.0, V)  # token 0 most likely, then 1, 2, ...


def test_greedy_is_argmax():
    assert set(_draws(LOGITS[::-1], temperature=0.0)) == {V - 1}


def test_top_k_keeps_the_k_best():
    got = set(_draws(LOGITS, top_k=3))
    assert got <= {0, 1, 2} and len(got) == 3


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = np.exp(LOGITS) / np.exp(LOGITS).sum()
    need = int(np.searchsorted(np.cumsum(probs), 0.5)) + 1  # tokens to reach 50 % mass
    got = set(_draws(LOGITS, top_p=0.5))
    assert got <= set(range(need)) and len(got) == need
    assert set(_draws(LOGITS, top_p=1e-6)) == {0}  # the first token always stays


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    probs = np.exp(LOGITS) / np.exp(LOGITS).sum()
    keep = set(np.nonzero(probs >= 0.6 * probs[0])[0].tolist())
    got = set(_draws(LOGITS, min_p=0.6))
    assert got <= keep and len(got) == len(keep)


def test_temperature_sharpens_and_seeds_reproduce():
    hot = _draws(LOGITS, temperature=5.0)
    cold = _draws(LOGITS, temperature=0.2)
    assert len(set(hot)) > len(set(cold))
    np.testing.assert_array_equal(_draws(LOGITS, seeds=9), _draws(LOGITS, seeds=9))
    assert (_draws(LOGITS, seeds=9) != _draws(LOGITS, seeds=10)).any()


def test_a_row_draws_the_same_whatever_its_neighbours_ask():
    """The sort runs only when some row filters by top-k / top-p; an unfiltered row's draws
    do not change with it, and a greedy row stays the argmax in a sampled batch."""
    n = 64
    rows = jnp.broadcast_to(jnp.asarray(LOGITS, jnp.float32), (n, V))

    def run(temperature, top_k):
        return np.asarray(
            jax.jit(sample)(
                rows,
                _rows(n, temperature=temperature, top_k=top_k, seeds=5),
                jnp.arange(n, dtype=jnp.int32),
            )
        )

    alone = run(np.ones(n), np.zeros(n))
    mixed = run(np.r_[np.ones(n // 2), np.zeros(n // 4), np.ones(n // 4)],
                np.r_[np.zeros(n // 2), np.zeros(n // 4), np.full(n // 4, 2)])  # fmt: skip
    np.testing.assert_array_equal(mixed[: n // 2], alone[: n // 2])
    assert set(mixed[n // 2 : 3 * n // 4]) == {0}  # greedy
    assert set(mixed[3 * n // 4 :]) <= {0, 1}  # top-k 2
    assert len(set(alone)) > 2  # unfiltered rows do reach past the top two


def test_token_logprobs():
    logits = jnp.asarray(np.stack([LOGITS, LOGITS[::-1]]), jnp.float32)
    tokens = jnp.array([1, V - 1], jnp.int32)
    chosen, top_ids, top_lp = token_logprobs(logits, tokens)
    lp = np.asarray(jax.nn.log_softmax(logits))
    np.testing.assert_allclose(np.asarray(chosen), [lp[0, 1], lp[1, V - 1]], rtol=1e-6)
    assert top_ids.shape == (2, min(MAX_LOGPROBS, V))
    assert np.asarray(top_ids)[0, :3].tolist() == [0, 1, 2]
    assert np.asarray(top_ids)[1, 0] == V - 1
    assert np.all(np.diff(np.asarray(top_lp), axis=1) <= 0)


def test_blocked_top_k_is_lax_top_k():
    """Values and indices as ``lax.top_k`` gives them, ties to the lower index: a vocabulary
    that is not a multiple of the block (padding), rows of ties, rows half banned."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 10_000)).astype(np.float32)
    x[1] = np.round(x[1] * 2)  # ties across and within blocks
    # the 20th value a tie: 1.0 in the blocks of the ten largest (high indices) and as the
    # maximum of 20 low blocks; lax.top_k takes the lowest indices, those of blocks 0-9
    x[0] = -10.0
    x[0, np.arange(50, 60) * 128] = 100.0 + np.arange(10)
    x[0, np.arange(50, 60) * 128 + 1] = 1.0
    x[0, np.arange(20) * 128 + 5] = 1.0
    x[2, ::2] = -np.inf
    x[3, 9_990:] = 9.0  # the best in the padded block
    got = jax.jit(lambda x: blocked_top_k(x, MAX_LOGPROBS))(x)
    want = jax.lax.top_k(x, MAX_LOGPROBS)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


def test_searched_threshold_is_the_sorts():
    """The sort-free top-k / top-p threshold equals the sorted one: ties at the k-th value,
    banned (-inf) tokens, negative and positive logits, k = V (off), top-p alone, both at
    once, and each search width. Each top-p sits midway between two prefix masses (float64),
    so rounding cannot move the kept set."""
    rng = np.random.default_rng(7)
    v = 1000
    x = (rng.normal(size=(8, v)) * 3).astype(np.float32)
    x[1] = np.round(x[1])  # wide ties: the k-th value repeats
    x[2, rng.permutation(v)[: v // 2]] = -np.inf
    x[3] = -np.abs(x[3]) - 5.0  # all negative
    x[4] = np.abs(x[4]) + 5.0  # all positive
    x[5] = 0.5  # one value: everything ties
    k = np.array([5, 40, 17, v, v, 3, 1, 200], np.int32)
    top_p = np.ones(8, np.float32)
    # row 0: top-p keeps 3 of top-k's 5
    for row, p_rank in ((3, 30), (4, 7), (6, 50), (7, 100), (0, 2)):
        e = np.exp(np.sort(x[row].astype(np.float64))[::-1] - x[row].max())
        mass = np.cumsum(e) / e.sum()
        top_p[row] = (mass[p_rank - 1] + mass[p_rank]) / 2  # keeps p_rank + 1 tokens
    want = np.asarray(_sorted_threshold(jnp.asarray(x), jnp.asarray(k), jnp.asarray(top_p)))
    kept = (x >= want).sum(1)
    assert kept[0] == 3 and kept[1] >= 40 and kept[2] == 17 and kept[5] == v
    assert kept[3] == 31 and kept[4] == 8 and kept[6] == 1 and kept[7] == 101
    for ways, unroll in ((2, False), (4, False), (4, True), (16, True)):
        fn = jax.jit(lambda x, k, p, w=ways, u=unroll: _searched_threshold(x, k, p, w, u))
        got = np.asarray(fn(jnp.asarray(x), jnp.asarray(k), jnp.asarray(top_p)))
        np.testing.assert_array_equal(got, want, err_msg=f"ways={ways} unroll={unroll}")
