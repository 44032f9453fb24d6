"""The compiled tensor-parallel step moves what TP must move, and nothing else.

Per layer: one all-reduce of the ``[T, D]`` mixer output (row-parallel ``out_proj`` /
``o_proj``) and one of the MoE's (the routed experts' partial sums and the shared expert's
row-parallel ``down_proj`` added before the ``psum``: on two H200s each collective is a launch
of its own between CUDA graphs, a host cost per layer). No parameter is ever gathered:
left to sharding propagation, the LM head all-gathered its ``[D, V]`` weight on every step
(622 MB at Qwen3-Next-80B's 151936 x 2048 in bf16) to serve the sampler's gather.

The logits: up to ``WHOLE_LOGITS_BYTES`` one all-gather of the ``[S, V]`` rows on every step,
before sampling, and no collective inside a decode step's ``lax.cond`` (XLA:GPU keeps a
conditional with a collective out of its CUDA graphs, and syncs the host on its predicate).
Past the bound (``_split``) the argmax of the vocab-split logits exchanges ``[S, devices]``
partial maxima, and whole rows are gathered only inside the branches that need them (the sort,
the log-probs).

The step is compiled for 4 simulated CPU devices in a fresh interpreter
(``tp_worker collectives``: JAX reads the device count once, when it starts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.xla_flags import TEST_XLA_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEVICES = 4


@pytest.fixture(scope="module")
def report() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, XLA_FLAGS=TEST_XLA_FLAGS)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.serving.tp_worker", "collectives"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["collectives"]


STEPS = ["decode", "prefill", "decode_split", "prefill_split"]


@pytest.mark.parametrize("step", STEPS)
def test_tp_step_collectives_are_the_minimum(report, step):
    r = report[step]
    hidden, vocab, rows, tokens = report["hidden"], report["vocab"], r["rows"], r["tokens"]
    found = r["collectives"]
    params = {tuple(p) for p in report["params"]}
    gathered = [c for c in found if any(tuple(s) in params for s in c["shapes"])]
    assert gathered == [], f"a parameter crosses devices: {gathered}"
    assert {c["op"] for c in found} <= {"all-reduce", "all-gather"}, found

    every_step = [c for c in found if c["where"] == "entry"]
    reduced = [s for c in every_step if c["op"] == "all-reduce" for s in c["shapes"]]
    assert reduced == [[tokens, hidden]] * (2 * report["layers"]), every_step
    gathers = [c["shapes"] for c in every_step if c["op"] == "all-gather"]
    in_branches = [c for c in found if c["where"] != "entry"]
    if step.endswith("_split"):
        # the argmax over the vocab shards: each device's best value and index per row
        assert gathers == [[[rows, DEVICES]]] * 2, every_step
        assert in_branches, "the sort and the log-probs gather the logits"
    else:  # the logits rows whole, once
        assert gathers == [[[rows, vocab]]], every_step
        if step == "decode":
            assert in_branches == [], "a collective inside a lax.cond: a host sync on a GPU"
    for c in in_branches:  # (a prefill step's prompt log-probs gather their [P, V] rows)
        assert c["where"] == "branch" and c["op"] == "all-gather", c
        assert [s[-1] for s in c["shapes"]] == [vocab], c


def test_tp_branch_free_decode_step_has_no_conditional(report):
    """``branch_free_step``: no conditional in the TP decode step, and its collectives those of
    the decode step with branches (the logits gathered once), every one in the entry."""
    r = report["decode_branch_free"]
    assert r["conditionals"] == 0
    assert r["collectives"] == report["decode"]["collectives"]
    assert all(c["where"] == "entry" for c in r["collectives"])


@pytest.mark.parametrize("step", STEPS)
def test_tp_step_returns_the_tables_as_it_takes_them(report, step):
    """The token tables are donated: another sharding out than in would compile the step again
    on its next call (and copy the tables)."""
    assert report[step]["tables_keep_sharding"]
