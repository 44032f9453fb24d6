"""The full-size benchmarks' random build (``benchmarks.full_size``) on simulated CPU devices.

Every parameter must be created where the engine's sharding plan puts it, the engine must
take the model as it is (no copy of a placed parameter), and a generation must run at TP=4
with expert parallel (tensor and expert sharding in one build). A small model of the real
structure; one fresh interpreter with 4 CPU devices (this module run as a script), since JAX
reads the device count once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.xla_flags import with_devices

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def report() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    env["XLA_FLAGS"] = with_devices(4)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.serving.test_full_size_build"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["tp4_ep"])
def test_every_parameter_is_built_in_its_engine_place(report, case):
    r = report[case]
    assert r["misplaced"] == []
    assert r["sharded_params"] > 0  # the rules did split something


@pytest.mark.parametrize("case", ["tp4_ep"])
def test_engine_takes_the_sharded_model_without_a_copy(report, case):
    assert report[case]["same_buffers"]


@pytest.mark.parametrize("case", ["tp4_ep", "dummy_tp2_scan"])
def test_generation_runs(report, case):
    assert report[case]["tokens"] == 3


def test_dummy_load_format_builds_stacked_layers_in_their_shards(report):
    """``--load-format dummy --tensor-parallel-size 2 --scan-layers`` on a preset's config.json:
    every parameter (the stacked groups' included) drawn where the plan puts it."""
    r = report["dummy_tp2_scan"]
    assert r["scanned"] and r["misplaced"] == []
    assert r["group_conv_spec"] == "P(None, 'model', None)"  # [G, C, K]: channels split


def _worker() -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks.full_size import misplaced, model_config, random_sharded_model, sharding_plan
    from serving.core.request import EngineRequest, SamplingParams
    from serving.engine.llm_engine import EngineArgs, LLMEngine

    cfg = model_config("tiny-qwen3-next", 4)  # GDN x 3, attention; MoE with a shared expert
    out = {}
    for name, tp, ep in [("tp4_ep", 4, True)]:  # TP and EP at once: one build, one engine
        plan = sharding_plan(cfg, tp, ep)
        model = random_sharded_model(cfg, plan, dtype=jnp.float32)
        params = nnx.to_flat_state(nnx.state(model))
        sharded = sum(1 for _, v in params if len(v.get_value().sharding.device_set) > 1
                      and not v.get_value().sharding.is_fully_replicated)  # fmt: skip
        experts = model.layers[0].mlp.experts_gate.get_value()
        before = [s.data.unsafe_buffer_pointer() for s in experts.addressable_shards]
        engine = LLMEngine(
            EngineArgs(
                model=".",
                max_num_seqs=2,
                max_num_batched_tokens=64,
                min_token_bucket=64,
                mixed_row_buckets=False,
                max_model_len=64,
                block_size=16,
                enable_prefix_caching=False,
                kernel_backend="reference",
                cache_bytes=8 << 20,
                tensor_parallel_size=tp,
                enable_expert_parallel=ep,
                warmup=False,
                progress=False,
            ),
            preloaded=(model, cfg),
        )
        engine_experts = engine.runner.state["layers"][0]["mlp"]["experts_gate"].get_value()
        after = [s.data.unsafe_buffer_pointer() for s in engine_experts.addressable_shards]
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        engine.add_request(EngineRequest(list(range(1, 11)), params))
        done = engine.run_to_completion()
        out[name] = {
            "misplaced": misplaced(model, plan),
            "sharded_params": sharded,
            "same_buffers": before == after and len(set(after)) == tp,
            "tokens": len(next(iter(done.values())).output_token_ids),
        }
        del engine
        jax.clear_caches()
    out["dummy_tp2_scan"] = _dummy_tp2_scan()
    return out


def _dummy_tp2_scan() -> dict:
    import tempfile

    from flax import nnx

    from benchmarks.full_size import misplaced, write_config
    from serving.core.request import EngineRequest, SamplingParams
    from serving.engine.llm_engine import EngineArgs, LLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        write_config(tmp, "tiny-qwen3-next")  # 8 layers: two groups of [GDN x 3, attention]
        engine = LLMEngine(
            EngineArgs(
                model=tmp, load_format="dummy", dtype="float32", tensor_parallel_size=2,
                scan_layers=True, max_num_seqs=2, max_num_batched_tokens=64,
                min_token_bucket=64, max_model_len=64, kernel_backend="reference",
                cache_bytes=8 << 20, warmup=False, progress=False,
            )
        )  # fmt: skip
    runner = engine.runner
    model = nnx.merge(runner.graphdef, runner.state)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest(list(range(1, 11)), params))
    done = engine.run_to_completion()
    conv = runner.state["group_layers"][0]["linear_attn"]["conv1d"].get_value()
    return {
        "scanned": runner.scan_layers,
        "misplaced": misplaced(model, runner.sharding),
        "group_conv_spec": str(conv.sharding.spec),
        "tokens": len(next(iter(done.values())).output_token_ids),
    }


if __name__ == "__main__":
    print(json.dumps(_worker()))
