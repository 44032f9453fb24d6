"""The engine end to end on a tiny model: prefix caching on is token-identical to off.

The model is the long-memory tiny Qwen3-Next (its GDN states decay by 0.94-0.9997 a token), so
a hit that resumes from a wrong state changes the greedy tokens: the tests check that it does
(zeroing the cached states changes most hits' tokens). The hits must really happen (cached
tokens > 0 where a prefix repeats), under preemption and several token budgets too, and
nothing compiles after start-up. ``tests/mutations.py`` checks that these tests catch small
bugs of the caching path.
"""

import numpy as np
import pytest

from hyjax.tiny import make_tiny_model
from serving.core.request import EngineRequest, SamplingParams
from serving.engine.llm_engine import EngineArgs, LLMEngine
from tests.serving.engine_helpers import (
    assert_resumed_state_matters,
    run_waves,
)

G = 64  # checkpoint granularity: lcm(64, block_size 16)
BASE = dict(
    max_num_seqs=4,
    min_seq_bucket=4,  # one decode bucket: padded rows cost nothing on CPU
    max_num_batched_tokens=128,
    min_token_bucket=64,  # token buckets 64 and 128: 9 shapes to compile instead of 18
    max_model_len=512,
    num_checkpoint_slots=24,
    progress=False,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, long_memory=True)


@pytest.fixture(scope="module")
def engines(model_dir):
    on = LLMEngine(EngineArgs(model=model_dir, **BASE))
    off = LLMEngine(EngineArgs(model=model_dir, enable_prefix_caching=False, **BASE))
    return on, off


@pytest.fixture(scope="module")
def want(engines):
    """The caching-off run of ``workload()``: the tokens every caching run must reproduce."""
    return run_waves(engines[1], workload())


def _rand(rng, n):
    return rng.integers(0, 256, size=n).tolist()


def workload(seed=0, max_tokens=24):
    """Two waves: the first writes checkpoints, the second hits them.

    Checkpoints the first wave leaves (prompt end ``(P - 1) // G * G``, decode boundaries)::

        same_step_writer  X (70)       64
        a          A (150)             128
        nested_200 L[:200]             64 (a junction: exact, waiting, shares L[:128]), 192
        exact      L[:128]             128 (the boundary its last prefill chunk reaches)
        turn1      T (100) + 40 out    64, 128 (decode: the answer crosses 128)
    """
    rng = np.random.default_rng(seed)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.9, seed=7)
    answer = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    a = _rand(rng, 150)
    long = _rand(rng, 260)
    turn1 = _rand(rng, 100)
    x = _rand(rng, 70)
    wave1 = [
        # The writer's one step checkpoints 64 (its prompt end) and leaves budget for the
        # reader, which must wait for that step to write it (the same-step rule), then hit.
        ("same_step_writer", x, greedy),
        ("same_step_reader", x[:G] + _rand(rng, 9), greedy),
        ("a", a, greedy),
        ("nested_200", long[:200], greedy),
        ("exact", long[: 2 * G], greedy),  # N * G
        ("turn1", turn1, answer),
        ("one_token", _rand(rng, 1), greedy),
        ("g_minus_1", _rand(rng, G - 1), greedy),
    ]
    wave2 = [
        # A hit at 128 followed by 1, 2, 7 and 40 new prompt tokens.
        *((f"hit_plus_{n}", a[: 2 * G] + _rand(rng, n), greedy) for n in (1, 2, 7, 40)),
        # KV cached to 160 (a's prompt and answer), checkpoints only at 128: the hit is cut.
        ("kv_past_ckpt", lambda o: a + o["a"].output_token_ids + _rand(rng, 5), greedy),
        ("sampled", a + _rand(rng, 3), sampled),
        ("nested_260", long, greedy),
        ("nested_70", long[:70], greedy),
        ("exact_again", long[: 2 * G], greedy),
        ("exact_plus_1", long[: 2 * G + 1], greedy),  # N * G + 1
        ("exact_minus_1", long[: 2 * G - 1], greedy),  # N * G - 1
        ("turn2", lambda o: turn1 + o["turn1"].output_token_ids + _rand(rng, 11), greedy),
    ]
    return [wave1, wave2]


WAVE1 = {name for name, _, _ in workload()[0]}


def test_caching_is_token_identical_and_hits(engines, want):
    on, _ = engines
    compiles = on.runner.compile_count()
    got = run_waves(on, workload())
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].output_token_ids == want[name].output_token_ids, name
        assert want[name].num_cached_tokens == 0
    # Hits: the longest checkpoint at or below the KV hit, capped at num_tokens - 1.
    cached = {name: out.num_cached_tokens for name, out in got.items()}
    assert cached == {
        **{name: 0 for name in WAVE1 - {"exact", "same_step_reader"}},
        "same_step_reader": G,  # a step after the writer's
        "exact": G,  # the junction nested_200 checkpointed for it (same wave, admitted first)
        **{f"hit_plus_{n}": 2 * G for n in (1, 2, 7, 40)},
        "kv_past_ckpt": 2 * G,  # KV hit 160 cut to the checkpoint below it
        "sampled": 2 * G,  # a's prompt end (150 - 1) // 64 * 64
        "nested_260": 3 * G,  # nested_200's prompt end
        "nested_70": G,
        "exact_again": G,  # capped: (128 - 1) // 64 * 64
        "exact_plus_1": 2 * G,
        "exact_minus_1": G,
        "turn2": 2 * G,  # turn1's decode checkpoint: where its answer crossed 128
    }
    m = on.metrics()
    assert m.effective_hit_tokens > 0 and m.num_running == 0 and m.kv_usage == 0
    assert on.runner.compile_count() == compiles, "a step compiled after warm-up"


def test_lpm_admission_is_token_identical(model_dir, engines, want):
    """``--scheduling-policy lpm`` reorders admissions (hits first, none held behind a pending
    checkpoint): other chunks and hits than fcfs, the caching-off tokens all the same."""
    lpm = LLMEngine(
        EngineArgs(model=model_dir, **dict(BASE, warmup=False, scheduling_policy="lpm"))
    )
    compiles = lpm.runner.compile_count()
    got = run_waves(lpm, workload())
    for name in want:
        assert got[name].output_token_ids == want[name].output_token_ids, name
    assert sum(o.num_cached_tokens for o in got.values()) > 0
    assert lpm.runner.compile_count() == compiles  # the warm engines' executables serve


def test_resumed_state_matters(model_dir, engines, want):
    """With every cached state zeroed between the waves, most hits' tokens change: the model
    remembers its prefix through the recurrent state, so the identity test above sees a
    wrong resumed state (the KV hit alone does not carry the answer)."""
    fresh = LLMEngine(EngineArgs(model=model_dir, **dict(BASE, warmup=False)))
    assert_resumed_state_matters(fresh, workload(), want, WAVE1, num_hits=12)


def test_preemption_under_a_tiny_pool(model_dir):
    # KV for ~2.5 requests of ~280 tokens: four concurrent requests must preempt, and a
    # preempted request resumes through the same lookup. warmup=False: compile only the
    # buckets this workload meets (the warm-up itself is checked by
    # test_caching_is_token_identical_and_hits); these pools' shapes are new, so one token
    # bucket (128) keeps them to 6.
    tiny = dict(
        BASE,
        min_token_bucket=128,
        cache_bytes=45 * 4096 + 9 * 16896,
        num_checkpoint_slots=4,
        warmup=False,
    )
    on = LLMEngine(EngineArgs(model=model_dir, **tiny))
    off = LLMEngine(EngineArgs(model=model_dir, enable_prefix_caching=False, **tiny))
    assert on.runner.memory.num_kv_blocks < 4 * 18
    got = run_waves(on, workload(seed=1, max_tokens=80))
    want = run_waves(off, workload(seed=1, max_tokens=80))
    for name in want:
        assert got[name].output_token_ids == want[name].output_token_ids, name
    assert on.metrics().effective_hit_tokens > 0
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
    compiles = small.runner.compile_count()
    want = run_waves(on, workload(seed=2))
    got = run_waves(small, workload(seed=2))
    for name in want:
        assert got[name].output_token_ids == want[name].output_token_ids, name
    assert got["nested_260"].num_cached_tokens == 3 * G
    assert small.runner.compile_count() == compiles  # its buckets are a subset of `on`'s


def test_bad_requests_fail_alone(engines):
    on, _ = engines
    ok = on.add_request(EngineRequest([1, 2, 3], SamplingParams(max_tokens=4, temperature=0)))
    with pytest.raises(ValueError, match="maximum context length is 512"):
        on.add_request(EngineRequest(list(range(200)) * 3, SamplingParams(max_tokens=4)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        on.add_request(EngineRequest([1, 100000], SamplingParams(max_tokens=4)))
    with pytest.raises(ValueError, match="empty"):
        on.add_request(EngineRequest([], SamplingParams(max_tokens=4)))
    with pytest.raises(ValueError, match="temperature"):
        on.add_request(EngineRequest([1], SamplingParams(temperature=-1)))
    final = on.run_to_completion()
    assert len(final[ok].output_token_ids) == 4


def test_cache_salt_isolates_prefixes(engines):
    """A salted request hits only prefixes cached under its own salt; the tokens never change."""
    on, off = engines
    prompt = _rand(np.random.default_rng(7), 150)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def run(salt):
        rid = on.add_request(EngineRequest(prompt, greedy, cache_salt=salt))
        out = on.run_to_completion()[rid]
        return out.output_token_ids, out.num_cached_tokens

    ref_id = off.add_request(EngineRequest(prompt, greedy))
    ref = off.run_to_completion()[ref_id].output_token_ids
    first = run("tenant-a")
    cached = {salt: run(salt) for salt in ("tenant-a", "tenant-b", None)}
    assert first == (ref, 0)
    assert cached["tenant-a"] == (ref, 128)  # the checkpoint at 2 x G = 128 tokens
    assert cached["tenant-b"] == (ref, 0) and cached[None] == (ref, 0)
    assert run(None) == (ref, 128)  # unsalted requests share among themselves
    with pytest.raises(ValueError, match="cache_salt"):
        on.add_request(EngineRequest([1, 2], greedy, cache_salt=""))


def test_stop_strings_and_abort(engines):
    on, off = engines
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    rid = off.add_request(EngineRequest("Hello world", params))
    full = off.run_to_completion()[rid]
    assert len(full.text) > 4
    stop = full.text[3:5]
    rid = on.add_request(
        EngineRequest("Hello world", SamplingParams(**{**params.__dict__, "stop": (stop,)}))
    )
    out = on.run_to_completion()[rid]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    rid = on.add_request(EngineRequest("abort me", params))
    on.step()
    on.abort_request(rid)
    assert not on.has_unfinished_requests()
    assert on.metrics().kv_usage == 0 and on.metrics().state_usage == 0
