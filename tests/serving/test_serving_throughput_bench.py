"""``benchmarks.serving_throughput --wait-all-shards``: the runner's fetch then also waits for
every shard of the step's results, after reading them."""

from __future__ import annotations

import jax

from benchmarks import serving_throughput
from serving.worker.runner import ModelRunner


def test_wait_all_shards_waits_for_the_results_after_the_fetch(monkeypatch):
    calls = []
    monkeypatch.setattr(ModelRunner, "fetch", staticmethod(lambda step: calls.append("fetch")))
    monkeypatch.setattr(jax, "block_until_ready", lambda x: calls.append(("wait", x)))

    class Step:
        out = ("results", "drafts")

    serving_throughput.wait_all_shards()
    ModelRunner.fetch(Step())
    assert calls == ["fetch", ("wait", ("results", "drafts"))]
