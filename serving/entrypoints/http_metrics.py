"""Prometheus metrics of ``hyjax serve`` (``GET /metrics``), in their own registry.

Two sources: latencies the HTTP layer observes per request (time to first token, inter-token
latency, end-to-end latency, finished requests by reason), and the engine's own counters and
gauges, fetched from the engine process at scrape time (``EngineStats``) and exposed through a
collector, so a scrape always shows the pools as they are right now.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from serving.engine.messages import EngineStats

PREFIX = "hyjax:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300)


class _EngineCollector(Collector):
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator:
        s = self.stats
        if s is None:
            return
        labels = ["model_name"]
        lv = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            g.add_metric(lv, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            c.add_metric(lv, value)
            return c

        yield gauge("num_requests_running", "Requests holding a running slot.", s.num_running)
        yield gauge("num_requests_waiting", "Requests queued for admission.", s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks held (0-1).", s.kv_usage)
        yield gauge("state_cache_usage_perc", "Fraction of state slots held (0-1).", s.state_usage)
        yield counter("num_preemptions", "Preemptions (recompute).", s.num_preemptions)
        yield counter("prompt_tokens", "Prompt tokens admitted.", s.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", s.generation_tokens)
        yield counter("engine_steps", "Engine steps reported.", s.steps)
        yield counter(
            "engine_step_host_seconds",
            "Seconds of the engine's steps on the host (schedule, launch, update, detokenize).",
            s.step_host_seconds,
        )
        yield counter(
            "engine_step_device_seconds",
            "Seconds of the engine's steps spent waiting for the device.",
            s.step_device_seconds,
        )
        yield counter(
            "engine_loop_seconds",
            "Seconds of the engine loop around its steps (requests in, deltas out).",
            s.loop_seconds,
        )
        pool_labels = [*labels, "pool"]
        queries = CounterMetricFamily(
            PREFIX + "prefix_cache_queries", "Prompt tokens looked up.", labels=pool_labels
        )
        hits = CounterMetricFamily(
            PREFIX + "prefix_cache_hits", "Prompt tokens found cached.", labels=pool_labels
        )
        for pool, query, hit in (
            ("kv", s.kv_query_tokens, s.kv_hit_tokens),
            ("state", s.state_query_tokens, s.state_hit_tokens),
        ):
            queries.add_metric([*lv, pool], query)
            hits.add_metric([*lv, pool], hit)
        yield queries
        yield hits
        yield counter(
            "prefix_cache_effective_hits",
            "Prompt tokens skipped (KV hit intersected with a state checkpoint).",
            s.effective_hit_tokens,
        )
        yield from _spec_metrics(s, labels, lv)


def _spec_metrics(s: EngineStats, labels: list[str], lv: list[str]) -> Iterator:
    """Speculative decoding's counters (vLLM's names); the mean acceptance length is
    ``1 + accepted / drafts`` (``rate(...)`` of both in a query)."""
    for name, doc, value in (
        ("spec_decode_num_drafts", "Verify rows (requests' steps with drafts).", s.spec_num_drafts),
        ("spec_decode_num_draft_tokens", "Draft tokens verified.", s.spec_num_draft_tokens),
        ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_num_accepted_tokens),
    ):
        c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
        c.add_metric(lv, value)
        yield c
    per_pos = CounterMetricFamily(
        PREFIX + "spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in the draft (0 = first).",
        labels=[*labels, "position"],
    )
    for j, n in enumerate(s.spec_accepted_per_pos):
        per_pos.add_metric([*lv, str(j)], n)
    yield per_pos


class ServerMetrics:
    """The registry and the metrics the HTTP layer records."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self._engine = _EngineCollector(model_name)
        self.registry.register(self._engine)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from request arrival to its first token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between successive tokens of a request.",
            labels,
            buckets=ITL_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            labels,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self._finished = Counter(
            PREFIX + "request_success",
            "Finished choices, by finish reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self._model = model_name

    def finished(self, reason: str | None) -> None:
        self._finished.labels(self._model, reason or "none").inc()

    def render(self, stats: EngineStats | None) -> bytes:
        """The text exposition; ``stats`` None leaves the engine's metrics out."""
        self._engine.stats = stats
        return generate_latest(self.registry)
