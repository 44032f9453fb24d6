"""The engine end to end on a tiny model: prefix caching on is token-identical to off.

The hits must really happen (cached tokens > 0 where a prefix repeats), under preemption and
several token budgets too, and nothing compiles after start-up.
"""

import numpy as np
import pytest

from hyjax.tiny import make_tiny_model
from serving.engine import EngineArgs, LLMEngine
from serving.request import SamplingParams

G = 64  # checkpoint granularity: lcm(64, block_size 16)
BASE = dict(
    max_num_seqs=4,
    max_num_batched_tokens=128,
    max_model_len=512,
    num_checkpoint_slots=24,
    progress=False,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def engines(model_dir):
    on = LLMEngine(EngineArgs(model=model_dir, **BASE))
    off = LLMEngine(EngineArgs(model=model_dir, enable_prefix_caching=False, **BASE))
    return on, off


def _rand(rng, n):
    return rng.integers(0, 256, size=n).tolist()


def run_waves(engine, waves):
    """Each wave is a list of (name, prompt ids or callable(prev outputs), params)."""
    outputs = {}
    for wave in waves:
        names = {}
        for name, prompt, params in wave:
            if callable(prompt):
                prompt = prompt(outputs)
            names[engine.add_request(prompt, params)] = name
        for rid, out in engine.run_to_completion().items():
            outputs[names[rid]] = out
    return outputs


def workload(seed=0, max_tokens=24):
    rng = np.random.default_rng(seed)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.9, seed=7)
    shared = _rand(rng, 150)
    long = _rand(rng, 260)
    turn1 = _rand(rng, 100)
    wave1 = [
        ("shared_a", shared + _rand(rng, 9), greedy),
        ("nested_200", long[:200], greedy),
        ("exact", long[: 2 * G], greedy),  # N * G
        ("turn1", turn1, greedy),
        ("one_token", _rand(rng, 1), greedy),
        ("g_minus_1", _rand(rng, G - 1), greedy),
    ]
    wave2 = [
        ("shared_b", shared + _rand(rng, 20), greedy),
        ("shared_c", shared + _rand(rng, 3), sampled),
        ("nested_260", long, greedy),
        ("nested_70", long[:70], greedy),
        ("exact_again", long[: 2 * G], greedy),
        ("exact_plus_1", long[: 2 * G + 1], greedy),  # N * G + 1
        ("exact_minus_1", long[: 2 * G - 1], greedy),  # N * G - 1
        ("turn2", lambda o: turn1 + o["turn1"].output_token_ids + _rand(rng, 11), greedy),
    ]
    return [wave1, wave2]


def test_caching_is_token_identical_and_hits(engines):
    on, off = engines
    compiles = on.runner.compile_count()
    got = run_waves(on, workload())
    want = run_waves(off, workload())
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].output_token_ids == want[name].output_token_ids, name
        assert want[name].num_cached_tokens == 0
    # Hits: the longest checkpoint at or below the KV hit, capped at num_tokens - 1.
    assert got["shared_b"].num_cached_tokens == 2 * G  # prompt end (158 - 1) // 64 * 64
    assert got["shared_c"].num_cached_tokens == 2 * G
    assert got["nested_260"].num_cached_tokens == 3 * G  # decode boundary of nested_200
    assert got["exact_again"].num_cached_tokens == G  # capped: (128 - 1) // 64 * 64
    assert got["exact_plus_1"].num_cached_tokens == 2 * G  # decode boundary of `exact`
    assert got["turn2"].num_cached_tokens >= G
    assert got["nested_70"].num_cached_tokens == G
    m = on.metrics()
    assert m.effective_hit_tokens > 0 and m.num_running == 0 and m.kv_usage == 0
    assert on.runner.compile_count() == compiles, "a step compiled after warm-up"


def test_preemption_under_a_tiny_pool(model_dir):
    # KV for ~2.5 requests of ~280 tokens: four concurrent requests must preempt.
    # warmup=False: compile only the buckets this workload meets (the warm-up itself is
    # checked by test_caching_is_token_identical_and_hits); these pools' shapes are new.
    tiny = dict(BASE, cache_bytes=45 * 4096 + 9 * 16896, num_checkpoint_slots=4, warmup=False)
    on = LLMEngine(EngineArgs(model=model_dir, **tiny))
    off = LLMEngine(EngineArgs(model=model_dir, enable_prefix_caching=False, **tiny))
    assert on.runner.memory.num_kv_blocks < 4 * 18
    got = run_waves(on, workload(seed=1, max_tokens=80))
    want = run_waves(off, workload(seed=1, max_tokens=80))
    for name in want:
        assert got[name].output_token_ids == want[name].output_token_ids, name
    assert on.metrics().num_preemptions > 0
    assert off.metrics().num_preemptions > 0
    for e in (on, off):
        m = e.metrics()
        assert m.num_running == m.num_waiting == 0 and m.kv_usage == 0 and m.state_usage == 0


def test_token_budgets_agree(engines, model_dir):
    on, _ = engines
    small = LLMEngine(
        EngineArgs(model=model_dir, **dict(BASE, max_num_batched_tokens=64, warmup=False))
    )
    want = run_waves(on, workload(seed=2))
    got = run_waves(small, workload(seed=2))
    for name in want:
        assert got[name].output_token_ids == want[name].output_token_ids, name


def test_bad_requests_fail_alone(engines):
    on, _ = engines
    ok = on.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0))
    with pytest.raises(ValueError, match="maximum context length is 512"):
        on.add_request(list(range(200)) * 3, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        on.add_request([1, 100000], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        on.add_request([], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="temperature"):
        on.add_request([1], SamplingParams(temperature=-1))
    final = on.run_to_completion()
    assert len(final[ok].output_token_ids) == 4


def test_stop_strings_and_abort(engines):
    on, off = engines
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    full = off.run_to_completion() or None
    rid = off.add_request("Hello world", params)
    full = off.run_to_completion()[rid]
    assert len(full.text) > 4
    stop = full.text[3:5]
    rid = on.add_request("Hello world", SamplingParams(**{**params.__dict__, "stop": (stop,)}))
    out = on.run_to_completion()[rid]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    rid = on.add_request("abort me", params)
    on.step()
    on.abort_request(rid)
    assert not on.has_unfinished_requests()
    assert on.metrics().kv_usage == 0 and on.metrics().state_usage == 0
