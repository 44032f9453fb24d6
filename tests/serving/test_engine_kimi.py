"""The engine end to end on a tiny Kimi-Linear (KDA + MLA latent cache, tiktoken tokenizer).

Prefix caching on must be token-identical to off, with real hits (checkpointed KDA states
plus cached MLA latent blocks), and nothing may compile after start-up. Few buckets
(one token bucket, two sequence buckets) keep the compile time small.
"""

import numpy as np
import pytest

from hyjax.testing import make_tiny_kimi_linear_model
from serving.engine import EngineArgs, LLMEngine
from serving.request import SamplingParams

G = 64  # checkpoint granularity: lcm(64, block_size 16)
BASE = dict(
    max_num_seqs=2,
    max_num_batched_tokens=64,
    min_token_bucket=64,
    max_model_len=256,
    num_checkpoint_slots=12,
    progress=False,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_kimi_linear_model(tmp_path_factory.mktemp("kimi"), seed=0)


def run_waves(engine, waves):
    outputs = {}
    for wave in waves:
        names = {engine.add_request(prompt, params): name for name, prompt, params in wave}
        for rid, out in engine.run_to_completion().items():
            outputs[names[rid]] = out
    return outputs


def workload():
    rng = np.random.default_rng(0)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7)
    shared = rng.integers(0, 256, size=140).tolist()
    return [
        [("a", shared + [1, 2, 3], greedy), ("exact", shared[: 2 * G], greedy)],
        [
            ("b", shared + [4, 5, 6, 7, 8], greedy),
            ("c", shared[:100] + [9], sampled),
            ("exact_plus_1", shared[: 2 * G + 1], greedy),
        ],
    ]


def test_kimi_caching_on_off_identical_and_hits(model_dir):
    on = LLMEngine(EngineArgs(model=model_dir, **BASE))
    off = LLMEngine(EngineArgs(model=model_dir, enable_prefix_caching=False, **BASE))
    assert on.tokenizer is not None  # tiktoken.model + tokenizer_config.json, no tokenizer.json
    compiles = on.runner.compile_count()
    got, want = run_waves(on, workload()), run_waves(off, workload())
    for name in want:
        assert got[name].output_token_ids == want[name].output_token_ids, name
        assert want[name].num_cached_tokens == 0
    assert got["b"].num_cached_tokens == 2 * G  # a's prompt-end checkpoint (143 - 1) // 64
    assert got["c"].num_cached_tokens == G
    assert got["exact_plus_1"].num_cached_tokens == 2 * G
    assert on.runner.compile_count() == compiles, "a step compiled after warm-up"
    m = on.metrics()
    assert m.num_running == 0 and m.kv_usage == 0
    text = on.run_to_completion() or on.add_request("Hello", SamplingParams(max_tokens=3))
    assert len(on.run_to_completion()[text].output_token_ids) == 3


def test_kimi_generate_cli(model_dir, tmp_path):
    """``hyjax generate`` on the Kimi checkpoint, as a user runs it (a real subprocess)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "out.jsonl"
    cmd = [
        sys.executable, "-m", "serving.cli", "generate", "--model", model_dir,
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
