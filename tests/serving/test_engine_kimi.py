"""The engine end to end on a tiny Kimi-Linear (KDA + MLA latent cache, tiktoken tokenizer).

Prefix caching on must be token-identical to off, with real hits (checkpointed KDA states
plus cached MLA latent blocks), and nothing may compile after start-up. The model is the
long-memory one (KDA gates decaying by 0.94-0.9997 a token), so a wrong resumed state changes
the tokens: zeroing the cached states changes most hits. Few buckets (one token bucket, two
sequence buckets) keep the compile time small.
"""

import numpy as np
import pytest

from hyjax.testing import make_tiny_kimi_linear_model
from serving.core.request import EngineRequest, SamplingParams
from serving.engine.llm_engine import EngineArgs, LLMEngine
from tests.serving.engine_helpers import (
    assert_resumed_state_matters,
    run_waves,
)

G = 64  # checkpoint granularity: lcm(64, block_size 16)
BASE = dict(
    max_num_seqs=2,
    min_seq_bucket=2,  # one decode bucket
    # One token bucket; 128 tokens leave a step room for a second prompt (the same-step rule).
    max_num_batched_tokens=128,
    min_token_bucket=128,
    max_model_len=256,
    num_checkpoint_slots=12,
    progress=False,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_kimi_linear_model(tmp_path_factory.mktemp("kimi"), seed=0, long_memory=True)


def workload():
    """The first wave leaves checkpoints at 64 (a junction a writes for exact, which waits
    in the queue and shares A[:128]) and 128 (a's prompt end) of A, and at 64 and 128 of
    turn1 (prompt end; the decode boundary its answer crosses); the second wave hits them."""
    rng = np.random.default_rng(0)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7)
    answer = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    a = rng.integers(0, 256, size=140).tolist()
    turn1 = rng.integers(0, 256, size=100).tolist()

    def rand(n):
        return rng.integers(0, 256, size=n).tolist()

    x = rand(70)

    return [
        [
            # The writer's one step checkpoints 64 (its prompt end) and leaves budget for the
            # reader, which must wait for that step to write it (the same-step rule), then hit.
            ("same_step_writer", x, greedy),
            ("same_step_reader", x[:G] + rand(9), greedy),
            ("a", a, greedy),
            ("exact", a[: 2 * G], greedy),
            ("turn1", turn1, answer),
        ],
        [
            # A hit at 128 followed by 1, 2, 7 and 40 new prompt tokens.
            *((f"hit_plus_{n}", a[: 2 * G] + rand(n), greedy) for n in (1, 2, 7, 40)),
            # KV cached to 144 (a's prompt and answer), checkpoints at 64 and 128: cut to 128.
            ("kv_past_ckpt", lambda o: a + o["a"].output_token_ids + rand(3), greedy),
            ("nested_101", a[:100] + [9], sampled),
            ("exact_plus_1", a[: 2 * G + 1], greedy),
            ("turn2", lambda o: turn1 + o["turn1"].output_token_ids + rand(5), greedy),
        ],
    ]


WAVE1 = {name for name, _, _ in workload()[0]}


@pytest.fixture(scope="module")
def engines(model_dir):
    on = LLMEngine(EngineArgs(model=model_dir, **BASE))
    off = LLMEngine(EngineArgs(model=model_dir, enable_prefix_caching=False, **BASE))
    return on, off


@pytest.fixture(scope="module")
def want(engines):
    """The caching-off run: the tokens every caching run must reproduce."""
    return run_waves(engines[1], workload())


def test_kimi_caching_on_off_identical_and_hits(engines, want):
    on, _ = engines
    assert on.tokenizer is not None  # tiktoken.model + tokenizer_config.json, no tokenizer.json
    compiles = on.runner.compile_count()
    got = run_waves(on, workload())
    for name in want:
        assert got[name].output_token_ids == want[name].output_token_ids, name
        assert want[name].num_cached_tokens == 0
    cached = {name: out.num_cached_tokens for name, out in got.items()}
    assert cached == {
        "same_step_writer": 0,
        "same_step_reader": G,  # a step after the writer's
        "a": 0,
        "exact": G,  # the junction a checkpointed for it: (128 - 1) // 64 * 64
        "turn1": 0,
        **{f"hit_plus_{n}": 2 * G for n in (1, 2, 7, 40)},
        "kv_past_ckpt": 2 * G,
        "nested_101": G,
        "exact_plus_1": 2 * G,
        "turn2": 2 * G,  # turn1's decode checkpoint
    }
    assert on.runner.compile_count() == compiles, "a step compiled after warm-up"
    m = on.metrics()
    assert m.num_running == 0 and m.kv_usage == 0
    text = on.add_request(EngineRequest("Hello", SamplingParams(max_tokens=3)))
    assert len(on.run_to_completion()[text].output_token_ids) == 3


def test_kimi_resumed_state_matters(model_dir, engines, want):
    """Every cached KDA state zeroed between the waves: most hits' tokens change."""
    fresh = LLMEngine(EngineArgs(model=model_dir, **dict(BASE, warmup=False)))
    assert_resumed_state_matters(fresh, workload(), want, WAVE1, num_hits=8)


def test_kimi_generate_cli(model_dir, tmp_path):
    """``hyjax generate`` on the Kimi checkpoint, as a user runs it (a real subprocess)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "out.jsonl"
    cmd = [
        sys.executable, "-m", "serving.entrypoints.cli", "generate", "--model", model_dir,
        "--prompt", "Hello Kimi", "--prompt", "def f(x):", "--max-tokens", "6",
        "--output", str(out), "--max-num-seqs", "2", "--max-num-batched-tokens", "64",
        "--max-model-len", "128", "--quiet",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["Hello Kimi", "def f(x):"]
    for r in rows:
        assert r["finish_reason"] in ("length", "stop") and 1 <= len(r["output_token_ids"]) <= 6
        assert r["num_prompt_tokens"] == len(r["prompt"].encode())  # byte-level tiktoken ranks
