"""Prometheus metrics for `ffl-serve` (GET /metrics), in a registry of the server's own.

Engine state (running, waiting, KV blocks, preemptions, cancellations, tokens) is read from the
engine at scrape time; latencies and errors are recorded by the HTTP layer as they happen.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5, 10, 20, 40)


class _EngineCollector:
    def __init__(self, engine_of):
        self.engine_of = engine_of

    def collect(self):
        engine = self.engine_of()
        if engine is None:
            return
        load, stats = engine.load(), engine.scheduler.stats
        for name, doc in (("running", "requests in the running batch"), ("waiting", "requests queued")):
            yield GaugeMetricFamily(f"ffl_requests_{name}", doc, value=load[name])
        yield GaugeMetricFamily("ffl_kv_blocks_used", "KV cache blocks in use", value=load["blocks_used"])
        yield GaugeMetricFamily("ffl_kv_blocks_free", "KV cache blocks free", value=load["blocks_free"])
        counters = (("preemptions", "ffl_requests_preempted", "preemptions (a request's blocks freed, recomputed)"),
                    ("cancelled", "ffl_requests_cancelled", "requests cancelled (client gone, timeout, shutdown)"),
                    ("prefill_tokens", "ffl_prompt_tokens", "prompt tokens prefilled (recomputation included)"),
                    ("tokens", "ffl_generation_tokens", "tokens generated"))
        for key, name, doc in counters:
            yield CounterMetricFamily(name, doc, value=stats.get(key, 0))
        finished = CounterMetricFamily("ffl_requests_finished", "engine requests finished, by reason",
                                       labels=["reason"])
        for reason in ("stop", "length", "cancelled", "error"):
            finished.add_metric([reason], stats.get(reason, 0))
        yield finished


class ServerMetrics:
    def __init__(self, engine_of):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine_of))
        self.ttft = Histogram("ffl_time_to_first_token_seconds", "arrival to first token, per choice",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("ffl_inter_token_latency_seconds", "between consecutive tokens of a choice",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.requests = Counter("ffl_http_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=self.registry)
        self.errors = Counter("ffl_request_errors", "requests that failed, by kind", ["kind"],
                              registry=self.registry)

    def token(self, seconds: float, first: bool) -> None:
        (self.ttft if first else self.itl).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
