"""``benchmarks.serving_throughput``'s pure parts: a run's byte floor a card, and
``--wait-all-shards`` (the runner's fetch then also waits for every shard of the step's
results, after reading them)."""

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


def test_floor_is_split_over_the_cards():
    floor = {"total": 8e9}  # bytes of the whole step
    got = serving_throughput.floor_fields(floor, tp=2, bandwidth=4e12, itl_ms={"p50": 2.0})
    assert got == {"floor_gb_per_card": 4.0, "floor_ms_per_card": 1.0, "itl_p50_over_floor": 2.0}
    one = serving_throughput.floor_fields(floor, tp=1, bandwidth=4e12, itl_ms=None)
    assert one == {"floor_gb_per_card": 8.0, "floor_ms_per_card": 2.0}
