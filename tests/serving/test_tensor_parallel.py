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

from tests.xla_flags import TEST_XLA_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Every float check bounds max |got - ref| / max |ref|: two float32 computations of the same
# logits (or states) that differ in reduction order only. TP sums the partial products of a
# row-split projection (attention and GDN / KDA output, MoE down projections) across devices
# in another order, and the Pallas kernels chunk the recurrence differently; that moves a
# value by a few ulps of the largest terms: ~1e-7 to 1.4e-6 relative measured here (AMD
# EPYC), and its size depends on the host's vector width and XLA's codegen, so an absolute
# bound at that noise floor passes on one CI host and fails on another. A real bug (a head or
# expert on the wrong device, a state shard read from the wrong slot or head, a missing
# all-reduce) changes the logits by O(their magnitude): above 1e-2 relative. 1e-4 sits ~100x
# above the noise and ~100x below a bug.
RTOL = 1e-4


def _env() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    # The workers are dominated by compiling steps for 1, 2, 4 and 8 devices: the tests' lean
    # flags (tests/xla_flags.py; the worker adds its device count); both sides of every
    # comparison compile alike.
    env["XLA_FLAGS"] = TEST_XLA_FLAGS
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


def _rel_diff(a, b) -> float:
    """max |a - b| / max |b|."""
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _assert_matches_tp_1(case: str, r: dict) -> None:
    """Prefill logits, decode logits (after reading the prefill's states and KV) and a
    checkpoint slot written mid-prefill, each within RTOL of the one-device reference."""
    for name in ("prefill", "decode", "checkpoint"):
        assert r[f"{name}_scale"] > 0.1, (case, name)  # not trivially zero
        rel = r[name] / r[f"{name}_scale"]
        assert rel < RTOL, f"{case} {name}: relative difference {rel:.2e} ({r})"


def test_tp_2_4_logits_match_tp_1(report):
    logits = dict(report["logits"])
    del logits["tp=1"]
    assert set(logits) == {"tp=2", "tp=4 ep", "tp=2 interpret"}
    for case, r in logits.items():
        _assert_matches_tp_1(case, r)
    # The recurrent state pool is split by value head: 16 heads over n devices (TP = 8:
    # test_two_processes_jax_distributed).
    assert logits["tp=2"]["ssm_shard_shapes"] == ["(5, 8, 8, 8)"]
    assert logits["tp=2 interpret"]["ssm_shard_shapes"] == ["(5, 8, 8, 8)"]
    assert logits["tp=4 ep"]["ssm_shard_shapes"] == ["(5, 4, 8, 8)"]


@pytest.mark.parametrize("case", ["tp=2 interpret", "kimi tp=2 interpret"])
def test_pallas_kernels_under_tp_2_match_reference_tp_1(report, case):
    """The Pallas kernels (GDN, conv1d, paged attention; KDA, MLA), run by the TPU interpreter
    under shard_map on two devices, against one device with the reference ops."""
    r = report["logits"][case] if case in report["logits"] else report["kimi_logits"][case]
    _assert_matches_tp_1(case, r)


@pytest.mark.parametrize("case", ["kimi tp=2", "kimi tp=4 ep", "kimi tp=8"])
def test_kimi_linear_tp_logits_match_tp_1(report, case):
    """8 KDA heads (Dk 8) and 8 MLA heads: every device runs its heads, the latent is whole."""
    r = report["kimi_logits"][case]
    n = int(case.split("=")[1].split()[0])
    _assert_matches_tp_1(case, r)  # the checkpoint: the KDA state after 4 tokens
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


# What the worker's workload (``tp_worker._workload``) must reuse: tokens taken from a cached
# checkpoint. Granularity 64; the shared prefix S is 216 tokens.
HITS = {
    "n": 128,  # nested prefix S[:140]: a junction checkpoint written inside a's prefill
    "a_again": 192,  # a's prompt again: KV cached up to 208, past the state checkpoint
    "hit1": 192,  # S[:192] followed by 1, 2, 7 and 40 prompt tokens, then 8 decoded
    "hit2": 192,
    "hit7": 192,
    "hit40": 192,
    "m_turn2": 128,  # a follow-up turn: the decode checkpoint inside m's 40-token answer
}
CACHED = {**HITS, "c": 192, "a": 0, "m": 0, "d": 0, "short": 0}  # c: sampled (top-p)


def _check_engine_tp2_matches_tp1(engine: dict) -> None:
    """The engine on two devices with prefix caching gives TP = 1's tokens, and caching off's;
    the hits happen and carry state: resumed from the zero state, their tokens change."""
    ref = engine["tp1_on"]
    assert set(ref) == set(CACHED)
    # Greedy and seeded sampled tokens (the draw does not depend on the vocab split).
    assert engine["tp2_on"] == ref
    assert engine["tp2_off"] == ref
    assert engine["tp2_on_cached"] == engine["tp1_on_cached"] == CACHED
    assert set(engine["tp2_off_cached"].values()) == {0}
    # The control run (TP = 1, every hit reads slot 0 instead of its checkpoint) proves the
    # tokens above depend on the resumed state: the long-memory model's linear-attention
    # layers remember the prefix, so a lost or misaddressed checkpoint shows.
    zero = engine["tp1_zero_resume"]
    assert engine["tp1_zero_resume_cached"] == CACHED
    changed = [name for name in HITS if zero[name] != ref[name]]
    assert len(changed) >= len(HITS) - 1, f"only {changed} depend on the resumed state"
    for name in ("a", "m", "short"):  # no hit: the control changes nothing else
        assert zero[name] == ref[name], name


def test_prefix_caching_under_tp2_matches_tp1(report):
    engine = report["engine"]
    _check_engine_tp2_matches_tp1(engine)
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


def test_kimi_prefix_caching_under_tp2_matches_tp1(report):
    """The tiny long-memory Kimi-Linear checkpoint (2 KDA heads, 2 MLA heads) on two devices."""
    engine = report["kimi_engine"]
    _check_engine_tp2_matches_tp1(engine)
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
        assert _rel_diff(r["prefill"], ref["prefill"]) < RTOL
        assert _rel_diff(r["decode"], ref["decode"]) < RTOL


@pytest.fixture(scope="module")
def scan_report() -> dict:
    """``--scan-layers`` under TP (``tp_worker scan``): its own process, started when asked."""
    return _result(_worker("scan"))["scan"]


@pytest.mark.parametrize("family", ["qwen3_next"])
def test_scanned_layers_under_tp_match_the_loop_and_one_device(scan_report, family):
    """Three groups scanned (a prefix and, for Qwen3-Next, a tail layer unrolled) on TP = 2 and
    TP = 4 with expert parallel: the greedy tokens of the per-layer loop on one device, a
    prefix hit resumed from a checkpoint of the stacked state pool included."""
    r = scan_report[family]
    assert r["groups"][1:] == [2, 3]  # period 2, 3 groups
    ref = r["tp1_loop"]
    assert r["tp1_loop_cached"]["hit"] == 128
    for run in ("tp2_scan", "tp4_ep_scan"):
        assert r[run] == ref, run
        assert r[f"{run}_cached"] == r["tp1_loop_cached"], run
        assert r[f"{run}_scanned"] == run.endswith("scan"), run
    # The stacked parameters keep their rule behind an unsplit group axis; the stacked
    # pools are split by head as the loop's (3 groups end to end along the slot axis).
    specs = r["tp2_scan_group_specs"]
    assert "P()" in specs and all(s == "P()" or s.startswith("P(None,") for s in specs)
    # The scanned TP step updates the donated stacked pools in place: no KV pool copied.
    assert r["tp2_scan_pool_copies"] == []
