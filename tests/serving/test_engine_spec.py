"""Speculative decoding end to end on the long-memory tiny models: greedy with verify rows is
token-identical to greedy without, with prefix caching on and off, over repeated and nested
prompts, follow-up turns, preemption, async scheduling, stop strings and max_tokens landing
inside a verified run.

Two drafters: the n-gram one (vLLM's prompt lookup), and an oracle that proposes the plain
run's own continuation with a wrong token from a varying position, so that every number of
accepted drafts (0..K) happens and the equality is not vacuous: a wrong slot rotation or
rollback resumes from a wrong state and, with these models' long memory, changes the tokens.
"""

import numpy as np
import pytest

from hyjax.testing import make_tiny_kimi_linear_model
from hyjax.tiny import make_tiny_model
from serving.core.request import EngineRequest, SamplingParams
from serving.engine.llm_engine import EngineArgs, LLMEngine
from tests.serving.engine_helpers import SPEC_ENGINE, oracle_drafter, run_waves

K = 3
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
BASE = SPEC_ENGINE
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def workload(seed=0, max_tokens=40):
    """Repeating prompts (the n-gram drafter finds matches), random ones, nested prefixes, and
    a follow-up turn over an answer (its decode checkpoint)."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    pat = rng.integers(0, 256, 10).tolist()
    long = rng.integers(0, 256, 260).tolist()
    turn = rng.integers(0, 256, 90).tolist()
    wave1 = [
        ("repeat", pat * 8, params),
        ("rand", rng.integers(0, 256, 70).tolist(), params),
        ("nested_200", long[:200], params),
        ("turn1", turn, params),
    ]
    wave2 = [
        ("nested_130", long[:130], params),
        ("nested_260", long, params),
        ("repeat_again", pat * 8, params),
        ("turn2", lambda outs: turn + outs["turn1"].output_token_ids + pat, params),
    ]
    return [wave1, wave2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, long_memory=True)


@pytest.fixture(scope="module")
def plain(model_dir):
    return LLMEngine(EngineArgs(model=model_dir, enable_prefix_caching=False, **BASE))


@pytest.fixture(scope="module")
def want(plain):
    return run_waves(plain, workload())


def _assert_same(got, want):
    for name in want:
        assert got[name].output_token_ids == want[name].output_token_ids, name


# Two of the four (drafter, caching) pairs: the CI's budget; test_engine_mtp.py runs a real
# drafter with caching on and off.
@pytest.mark.parametrize(
    ("drafter", "caching"), [("oracle", True), ("ngram", False)], ids=["oracle-caching", "ngram"]
)
def test_greedy_speculation_is_token_identical(model_dir, want, caching, drafter):
    e = LLMEngine(
        EngineArgs(model=model_dir, enable_prefix_caching=caching, speculative_config=NGRAM, **BASE)
    )
    if drafter == "oracle":
        oracle_drafter(e, want)
    got = run_waves(e, workload())
    _assert_same(got, want)
    m = e.metrics()
    assert m.spec_num_draft_tokens > 0
    if drafter == "oracle":
        assert m.spec_num_accepted_tokens > 0 and all(n > 0 for n in m.spec_accepted_per_pos)
        assert m.spec_num_accepted_tokens < m.spec_num_draft_tokens
    if caching:
        assert got["nested_260"].num_cached_tokens > 0 and got["turn2"].num_cached_tokens > 0
    assert m.num_running == m.num_waiting == 0 and m.kv_usage == 0 and m.state_usage == 0


def test_async_scheduling_with_speculation(model_dir, want):
    e = LLMEngine(
        EngineArgs(model=model_dir, speculative_config=NGRAM, async_scheduling=True, **BASE)
    )
    oracle_drafter(e, want)
    _assert_same(run_waves(e, workload()), want)
    assert e.metrics().spec_num_accepted_tokens > 0


def test_preemption_with_speculation(model_dir):
    # KV for ~2.5 requests (test_engine.py), slots for 4 checkpoints + 4 * K verify states
    tiny = dict(BASE, cache_bytes=45 * 4096 + (9 + 4 * K) * 16896, num_checkpoint_slots=4)
    on = LLMEngine(EngineArgs(model=model_dir, speculative_config=NGRAM, **tiny))
    off = LLMEngine(
        EngineArgs(
            model=model_dir,
            enable_prefix_caching=False,
            **{**tiny, "cache_bytes": 45 * 4096 + 9 * 16896},
        )
    )
    want = run_waves(off, workload(seed=1, max_tokens=80))
    oracle_drafter(on, want)
    got = run_waves(on, workload(seed=1, max_tokens=80))
    _assert_same(got, want)
    m = on.metrics()
    assert m.num_preemptions > 0 and m.spec_num_accepted_tokens > 0
    assert m.num_running == m.num_waiting == 0 and m.kv_usage == 0 and m.state_usage == 0


def _run(engine, params):
    rid = engine.add_request(EngineRequest("Hello world", params))
    return engine.run_to_completion()[rid]


def test_stop_string_and_max_tokens_inside_a_verified_run(model_dir, plain):
    rid = plain.add_request(EngineRequest("Hello world", GREEDY))
    full = plain.run_to_completion()[rid]
    e = LLMEngine(EngineArgs(model=model_dir, speculative_config=NGRAM, **BASE))
    seq = full.prompt_token_ids + full.output_token_ids

    class AllRight:
        def propose(self, req, k):
            n = len(req.all_token_ids)
            return seq[n : n + k]

    e.scheduler.drafter = AllRight()
    stop = full.text[5:7]
    params = SamplingParams(**{**GREEDY.__dict__, "stop": (stop,)})
    out = _run(e, params)
    assert out.finish_reason == "stop" and out.text == full.text[: full.text.index(stop)]
    n = len(out.output_token_ids)
    assert out.output_token_ids == full.output_token_ids[:n] and n < 40
    # the token that completes the stop string is the last one (as without speculation)
    rid = plain.add_request(EngineRequest("Hello world", params))
    assert plain.run_to_completion()[rid].output_token_ids == out.output_token_ids
    # max_tokens: the verify rows are capped, and a stop id inside a run truncates it
    for max_tokens in (2, 5, 7):
        params = SamplingParams(**{**GREEDY.__dict__, "max_tokens": max_tokens})
        out = _run(e, params)
        assert out.output_token_ids == full.output_token_ids[:max_tokens]
        assert out.finish_reason == "length"
    stop_id = full.output_token_ids[6]
    first = full.output_token_ids.index(stop_id)
    params = SamplingParams(**{**GREEDY.__dict__, "stop_token_ids": (stop_id,)})
    out = _run(e, params)
    assert out.output_token_ids == full.output_token_ids[: first + 1]
    assert out.finish_reason == "stop"
    assert e.metrics().spec_num_accepted_tokens > 0
    assert e.metrics().kv_usage == 0 and e.metrics().state_usage == 0


def test_kimi_greedy_speculation_is_token_identical(tmp_path_factory):
    d = make_tiny_kimi_linear_model(tmp_path_factory.mktemp("kimi"), seed=0, long_memory=True)
    off = LLMEngine(EngineArgs(model=d, enable_prefix_caching=False, **BASE))
    want = run_waves(off, workload(max_tokens=30))
    e = LLMEngine(EngineArgs(model=d, speculative_config=NGRAM, **BASE))
    oracle_drafter(e, want)
    got = run_waves(e, workload(max_tokens=30))
    _assert_same(got, want)
    assert e.metrics().spec_num_accepted_tokens > 0
    assert got["nested_260"].num_cached_tokens > 0
