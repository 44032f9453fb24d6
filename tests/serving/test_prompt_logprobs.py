"""Prompt logprobs (``SamplingParams.prompt_logprobs``) end to end through the engine, against
an oracle: the model's own forward over the whole prompt in one uncached step, every token's
logits, log-softmaxed in numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving.core.request import EngineRequest, SamplingParams

ENGINE = dict(
    max_num_seqs=4,
    min_seq_bucket=4,  # one decode bucket
    max_num_batched_tokens=128,
    min_token_bucket=128,
    max_model_len=512,
    num_checkpoint_slots=8,
    progress=False,
    warmup=False,
)
# float32 on CPU: the engine's chunked steps against one uncached step differ by ~1e-5 (the
# kernels' chunk order); a wrong position or target is off by whole nats.
ATOL = 2e-4
PROMPT = np.random.default_rng(0).integers(3, 200, 300).tolist()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from hyjax.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, long_memory=True)


def _engine(model_dir, **kw):
    from serving.engine.llm_engine import EngineArgs, LLMEngine

    return LLMEngine(EngineArgs(model=model_dir, **(ENGINE | kw)))


@pytest.fixture(scope="module")
def engine(model_dir):
    # At most 64 prompt positions a step: a 300-token prompt is scored over 5 steps.
    return _engine(model_dir, max_prompt_logprobs=64)


@pytest.fixture(scope="module")
def oracle_logprobs(model_dir):
    """f32[300, vocab]: log_softmax of the logits of every PROMPT token, one uncached step."""
    from hyjax.cache import init_caches
    from hyjax.loader import load_model
    from hyjax.ops import get_ops
    from hyjax.testing import SeqChunk, make_batch

    model, cfg = load_model(model_dir)
    n, bs = len(PROMPT), 16
    blocks = range(1, -(-n // bs) + 1)
    batch, _ = make_batch(
        [SeqChunk(PROMPT, 0, blocks, dst_slot=1, all_logits=True)],
        block_size=bs, num_tokens=n, num_seqs=1, max_blocks=len(blocks),
    )  # fmt: skip
    caches = init_caches(cfg, num_blocks=len(blocks) + 1, block_size=bs, num_slots=2,
                         dtype=jnp.float32)  # fmt: skip
    with jax.default_matmul_precision("highest"):
        _, logits = model(batch, caches, get_ops("reference"))
    return np.asarray(jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1))


def run(engine, requests):
    """Runs ``(prompt, params)`` pairs together; returns each one's final output with the
    prompt logprobs its first output carried."""
    ids = [engine.add_request(EngineRequest(list(p), sp)) for p, sp in requests]
    final, prompt = {}, {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.prompt_logprobs is not None:
                assert o.request_id not in prompt, "prompt logprobs reported twice"
                prompt[o.request_id] = o.prompt_logprobs
            if o.finished:
                final[o.request_id] = o
    for rid, o in final.items():
        o.prompt_logprobs = prompt.get(rid)
    return [final[i] for i in ids]


def greedy(**kw):
    return SamplingParams(**{"max_tokens": 4, "temperature": 0.0, "ignore_eos": True, **kw})


def check_against_oracle(plp, oracle, n_top):
    assert len(plp) == len(PROMPT) and plp[0] is None
    want = np.array([oracle[p, PROMPT[p + 1]] for p in range(len(PROMPT) - 1)])
    got = np.array([e.logprob for e in plp[1:]])
    assert [e.token_id for e in plp[1:]] == PROMPT[1:]
    np.testing.assert_allclose(got, want, atol=ATOL)
    for p, e in enumerate(plp[1:]):
        row = oracle[p]
        x = row[PROMPT[p + 1]]  # rank: up to near-ties
        assert 1 + (row > x + ATOL).sum() <= e.rank <= 1 + (row > x - ATOL).sum(), p
        ids, lps = zip(*e.top, strict=True)
        assert len(ids) == n_top
        np.testing.assert_allclose(lps, np.sort(row)[::-1][:n_top], atol=ATOL)
        np.testing.assert_allclose(row[list(ids)], lps, atol=ATOL)


def test_prompt_logprobs_match_an_uncached_forward(engine, oracle_logprobs):
    (out,) = run(engine, [(PROMPT, greedy(prompt_logprobs=3))])
    check_against_oracle(out.prompt_logprobs, oracle_logprobs, 3)


def test_chunked_prefill_scores_like_one_chunk(engine, model_dir):
    """The 300-token prompt over 5 capped chunks (budget 128, 64 positions a step) against
    one engine whose budget and cap take it in two steps (256 + 44 positions)."""
    big = _engine(model_dir, max_num_batched_tokens=512, min_token_bucket=512)
    (a,) = run(engine, [(PROMPT, greedy(prompt_logprobs=5))])
    (b,) = run(big, [(PROMPT, greedy(prompt_logprobs=5))])
    assert a.output_token_ids == b.output_token_ids
    la = np.array([e.logprob for e in a.prompt_logprobs[1:]])
    lb = np.array([e.logprob for e in b.prompt_logprobs[1:]])
    np.testing.assert_allclose(la, lb, atol=ATOL)
    assert [e.top[0][0] for e in a.prompt_logprobs[1:]] == [
        e.top[0][0] for e in b.prompt_logprobs[1:]
    ]


def test_a_cached_prefix_is_not_read_for_prompt_logprobs(engine, oracle_logprobs):
    """The same prompt ran before (its blocks and checkpoints are cached): a prompt-logprobs
    request still computes, and scores, every position."""
    run(engine, [(PROMPT, greedy())])
    (again,) = run(engine, [(PROMPT, greedy())])
    assert again.num_cached_tokens > 0  # the cache would serve it
    (out,) = run(engine, [(PROMPT, greedy(prompt_logprobs=1))])
    assert out.num_cached_tokens == 0
    check_against_oracle(out.prompt_logprobs, oracle_logprobs, 1)


def test_ordinary_requests_beside_it_are_unchanged(engine):
    """Requests sharing steps with a prompt-scoring one sample and report as when alone."""
    rng = np.random.default_rng(3)
    others = [rng.integers(3, 200, n).tolist() for n in (20, 90)]
    kw = dict(max_tokens=12, logprobs=2)
    alone = run(engine, [(p, greedy(**kw)) for p in others])
    mixed = run(engine, [(PROMPT, greedy(prompt_logprobs=2))] + [(p, greedy(**kw)) for p in others])
    for a, m in zip(alone, mixed[1:], strict=True):
        assert a.prompt_logprobs is None and m.prompt_logprobs is None
        assert a.output_token_ids == m.output_token_ids
    assert mixed[0].prompt_logprobs is not None


def test_one_token_prompt_has_only_the_null_entry(engine):
    (out,) = run(engine, [([7], greedy(prompt_logprobs=0))])
    assert out.prompt_logprobs == [None]


def test_prompt_logprobs_refused_when_off(model_dir):
    off = _engine(model_dir, max_prompt_logprobs=0)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        off.add_request(EngineRequest(PROMPT, greedy(prompt_logprobs=1)))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21).validate()
