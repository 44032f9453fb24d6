"""Verify-shaped buckets: a step whose rows are all decode and verify rows (at most K + 1 tokens
each, no prefill chunk) runs in a verify bucket (``StepShape.max_row_tokens``), whose GDN layers
call ``gdn_multi_decode``: with the ``interpret-gpu`` backend, the k-token decode Triton kernel
(``pallas_kernels/common/multi_decode_gpu.py``) in Pallas' interpreter, as on a GPU.

Each test records the shape of every step the engine runs and checks the routing (every step
of short rows in a verify bucket, verify rows in them, the others in decode or mixed buckets,
nothing outside ``step_shapes()``), and that greedy output with the oracle drafter (every
number of accepted drafts, on the long-memory tiny model) equals the output without
speculation, token for token.
"""

import dataclasses

import numpy as np
import pytest

from hyjax.tiny import make_tiny_model
from pallas_kernels.common import multi_decode_gpu
from serving.core.request import SamplingParams
from serving.engine.llm_engine import EngineArgs, LLMEngine
from tests.serving.engine_helpers import SPEC_ENGINE, oracle_drafter, run_waves

K = 3
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3}'


def workload(max_tokens):
    """Two prompts, then a nested prefix of one (a cache hit with caching on)."""
    rng = np.random.default_rng(3)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    long = rng.integers(0, 256, 150).tolist()
    wave1 = [("long", long, params), ("short", rng.integers(0, 256, 20).tolist(), params)]
    return [wave1, [("nested", long[:140] + [7, 8, 9], params)]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, long_memory=True)


def record_steps(engine: LLMEngine) -> list[tuple]:
    """Every plan the engine's runner gets from now on, as ``(shape, row lengths, drafts)``."""
    steps = []
    submit = engine.runner.submit

    def recording(plan, **kw):
        n = int(plan.num_seqs)
        lens = np.diff(plan.query_start_loc[: n + 1]).tolist()
        steps.append((plan.shape, lens, int(plan.num_drafts[:n].sum())))
        return submit(plan, **kw)

    engine.runner.submit = recording
    return steps


def assert_routed(engine: LLMEngine, steps: list[tuple]) -> int:
    """Every step of rows of at most K + 1 tokens (not all one token) ran in a verify bucket
    and the rest did not; returns the number of verify-bucket steps that verified drafts."""
    allowed = set(engine.sched_config.step_shapes())
    for shape, lens, _ in steps:
        assert shape in allowed, shape
        short = max(lens) <= K + 1 and sum(lens) > len(lens)
        assert shape.verify_only == short, (shape, lens)
        if shape.verify_only:
            assert shape.max_row_tokens == K + 1 and shape.num_tokens >= sum(lens)
    return sum(1 for shape, _, drafts in steps if shape.verify_only and drafts)


def spy_multi_decode(engine: LLMEngine) -> list[int]:
    """The ``max_tokens`` of every ``gdn_multi_decode`` call traced from now on (one a GDN
    layer per compiled verify bucket): the layers really take the verify path."""
    calls = []
    real = engine.runner.ops.gdn_multi_decode

    def spy(*args, max_tokens, **kw):
        calls.append(max_tokens)
        return real(*args, max_tokens=max_tokens, **kw)

    engine.runner.ops = dataclasses.replace(engine.runner.ops, gdn_multi_decode=spy)
    return calls


def _engine(model_dir, backend, caching, spec):
    args = dict(SPEC_ENGINE, kernel_backend=backend, enable_prefix_caching=caching)
    return LLMEngine(EngineArgs(model=model_dir, speculative_config=spec, **args))


def test_verify_steps_run_in_verify_buckets(model_dir, caching=True):
    """Caching on: the nested prompt hits (caching off takes the same path in these steps,
    tests/serving/test_engine_spec.py holds both equal to no speculation)."""
    want = run_waves(_engine(model_dir, "reference", False, None), workload(40))
    e = _engine(model_dir, "reference", caching, NGRAM)
    oracle_drafter(e, want)
    steps, calls = record_steps(e), spy_multi_decode(e)
    got = run_waves(e, workload(40))
    for name in want:
        assert got[name].output_token_ids == want[name].output_token_ids, name
    assert assert_routed(e, steps) >= 20
    assert calls and set(calls) == {K + 1}
    if caching:
        assert got["nested"].num_cached_tokens > 0
    m = e.metrics()
    assert all(n > 0 for n in m.spec_accepted_per_pos)
    assert m.num_running == m.num_waiting == 0 and m.kv_usage == 0 and m.state_usage == 0


def test_verify_buckets_run_the_multi_decode_gpu_kernel_exactly(model_dir):
    """The GPU column in the interpreter: without speculation (fused decode kernel), then with
    it (the k-token decode kernel in the verify steps), equal tokens."""
    rng = np.random.default_rng(4)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    waves = [[(f"p{n}", rng.integers(0, 256, n).tolist(), params) for n in (60, 20)]]
    want = run_waves(_engine(model_dir, "interpret-gpu", False, None), waves)
    e = _engine(model_dir, "interpret-gpu", False, NGRAM)
    assert e.runner.ops.gdn_multi_decode.func is multi_decode_gpu.gdn_multi_decode
    oracle_drafter(e, want)
    steps, calls = record_steps(e), spy_multi_decode(e)
    got = run_waves(e, waves)
    for name in want:
        assert got[name].output_token_ids == want[name].output_token_ids, name
    assert assert_routed(e, steps) >= 5
    assert calls and set(calls) == {K + 1}
    assert all(n > 0 for n in e.metrics().spec_accepted_per_pos)
