"""Tensor and expert parallelism on 8 simulated CPU devices, and two processes.

JAX reads ``--xla_force_host_platform_device_count`` once, when it starts, and the rest of the
suite runs on one device; so the checks run in fresh interpreters (``tp_worker.py``), once per
module, and each test here asserts on one part of what they report.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 2e-5  # f32 logits of magnitude ~1-5: only the reduction order differs (a bug: > 1e-2)


def _env() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    env["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false"
    return env


def _worker(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.serving.tp_worker", *args],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(proc: subprocess.Popen, timeout: float = 600) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return str(s.getsockname()[1])


@pytest.fixture(scope="module")
def reports() -> tuple[dict, list[dict]]:
    """The 8-device checks (Qwen3-Next and Kimi-Linear in two processes, one per CI core)
    and the two jax.distributed processes, started together."""
    port = _free_port()
    procs = [_worker("all"), _worker("kimi")]
    procs += [_worker("distributed", str(i), port) for i in range(2)]
    results = [_result(p) for p in procs]
    return {**results[0], **results[1]}, results[2:]


@pytest.fixture(scope="module")
def report(reports) -> dict:
    return reports[0]


def _max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


def test_tp_2_4_8_logits_match_tp_1(report):
    logits = dict(report["logits"])
    del logits["tp=1"]
    assert set(logits) == {"tp=2", "tp=4 ep", "tp=8"}
    for case, r in logits.items():
        assert r["logit_scale"] > 0.1, case  # the logits are not trivially zero
        assert r["prefill"] < TOL, (case, r)
        assert r["decode"] < TOL, (case, r)  # after reading the prefill's states and KV
        assert r["checkpoint"] < 1e-6, (case, r)  # a mid-prefill checkpoint slot
    # The recurrent state pool is split by value head: 16 heads over n devices.
    assert logits["tp=2"]["ssm_shard_shapes"] == ["(5, 8, 8, 8)"]
    assert logits["tp=4 ep"]["ssm_shard_shapes"] == ["(5, 4, 8, 8)"]
    assert logits["tp=8"]["ssm_shard_shapes"] == ["(5, 2, 8, 8)"]


@pytest.mark.parametrize("case", ["kimi tp=2", "kimi tp=4 ep", "kimi tp=8"])
def test_kimi_linear_tp_logits_match_tp_1(report, case):
    """8 KDA heads (Dk 8) and 8 MLA heads: every device runs its heads, the latent is whole."""
    r = report["kimi_logits"][case]
    n = int(case.split("=")[1].split()[0])
    assert r["logit_scale"] > 0.1
    assert r["prefill"] < TOL and r["decode"] < TOL, r
    assert r["checkpoint"] < 1e-6, r  # the KDA state after 4 tokens, written mid-prefill
    # KDA: q_proj [D=32, 8x8] by columns, o_proj [64, 32] by rows; pools by head / channel.
    assert r["kda_q_proj_shards"] == [f"(32, {64 // n})"]
    assert r["kda_o_proj_shards"] == [f"({64 // n}, 32)"]
    assert r["ssm_shards"] == [f"(5, {8 // n}, 8, 8)"]
    assert r["conv_shards"] == [f"(5, 3, {3 * 64 // n})"]
    # MLA: q_b_proj [16, 8x(8+4)] and kv_b_proj [16, 8x(8+8)] by head; the latent
    # (kv_lora 16 + rope 4) and kv_a_proj_with_mqa whole on every device.
    assert r["mla_q_b_proj_shards"] == [f"(16, {96 // n})"]
    assert r["mla_kv_b_proj_shards"] == [f"(16, {128 // n})"]
    assert r["mla_kv_a_shards"] == ["(32, 20)"]
    assert r["latent_shards"] == [r["latent_shape"]] and r["latent_shape"].endswith(", 20)")
    # Experts [E=8, D=32, F=16]: F split (TP) or E split (EP).
    ep = case.endswith("ep")
    assert r["experts_up_shards"] == [f"({8 // n}, 32, 16)" if ep else f"(8, 32, {16 // n})"]
    # Per device: a KV block costs what it costs on one device, a state slot 1/n of it.
    kv, slot = report["kimi_logits"]["kimi tp=1 pool_bytes"]
    assert r["pool_bytes"] == [kv, slot // n]


def test_prefix_caching_on_off_identical_under_tp2(report):
    engine = report["engine"]
    assert engine["tp2_on"] == engine["tp2_off"]
    hits = engine["tp2_on_cached"]
    assert hits["b"] == hits["c"] == hits["a_again"] == 128  # the 140-token shared prefix
    assert set(engine["tp2_off_cached"].values()) == {0}
    # Two kv heads over two devices: one per device.
    assert engine["tp2_on_kv_shards"] == ["(41, 16, 1, 16)"]
    assert engine["pool_log"] and all("KV pool split by kv head" in s for s in engine["pool_log"])
    # The donated pools are updated in place: the compiled step copies none of them whole.
    assert engine["tp2_on_pool_copies"] == []
    # The vocab-split logits never cross devices but as whole rows gathered for the sort and
    # the log-probs: no all-to-all, no collective over vocab shards (a partitioned sort and
    # cumsum were ~1.5 s a step on two H100s).
    assert engine["tp2_on_vocab_collectives"] == []
    assert engine["tp2_on_logits_gathers"]


def test_kimi_prefix_caching_on_off_identical_under_tp2(report):
    """The tiny Kimi-Linear checkpoint (2 KDA heads, 2 MLA heads) served on two devices."""
    engine = report["kimi_engine"]
    assert engine["tp2_on"] == engine["tp2_off"]
    hits = engine["tp2_on_cached"]
    assert hits["b"] == hits["c"] == hits["a_again"] == 128  # the 140-token shared prefix
    assert set(engine["tp2_off_cached"].values()) == {0}
    assert engine["tp2_on_conv_shards"][0].endswith(", 3, 48)")  # 3 x 2 heads x 16 over 2
    assert engine["tp2_on_kv_shards"][0].endswith(", 16, 24)")  # the whole latent (16 + 8)
    assert engine["pool_log"] and all("KV pool replicated" in s for s in engine["pool_log"])


def test_load_into_shards_and_orbax_restore(report):
    loading = report["loading"]
    # in_proj_qkvz [64, 8 groups x 48]: 2 key-head groups per device on TP = 4
    assert loading["qkvz_shards"] == ["(64, 96)"]
    assert loading["experts_down_spec"] == "P(None, 'model', None)"
    assert loading["load_max_diff"] == 0.0
    # Restored from the orbax checkpoint onto devices 2 and 3, experts split (EP).
    assert loading["restored_experts_spec"] == "P('model', None, None)"
    assert loading["restored_devices"] == [2, 3]
    assert loading["restore_max_diff"] == 0.0


def test_bad_sizes_are_named(report):
    errors = report["errors"]
    assert "must divide linear_num_key_heads=8" in errors["tp3"]
    assert "exceeds the 8 devices" in errors["tp16"]
    assert "must divide num_experts=4" in errors["ep16_experts"]
    assert "must divide linear_num_heads=8" in errors["kimi_tp3"]
    assert "must divide num_attention_heads=4" in errors["kimi_mla_heads"]
    assert "must divide moe_intermediate_size=12" in errors["kimi_expert_dim"]
    assert "must divide num_experts=4" in errors["kimi_ep_experts"]


def test_two_processes_jax_distributed(reports):
    """jax.distributed on one machine: two processes x 4 CPU devices, TP = 8 across both."""
    report, results = reports
    ref = report["logits"]["tp=1"]
    for i, r in enumerate(results):
        assert r["process_index"] == i
        assert r["devices"] == 8 and r["local_devices"] == 4
        assert r["local_ssm_shards"] == ["(5, 2, 8, 8)"]  # 16 heads / 8 devices
        assert _max_diff(r["prefill"], ref["prefill"]) < TOL
        assert _max_diff(r["decode"], ref["decode"]) < TOL
