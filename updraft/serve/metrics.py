"""Prometheus metrics of the server, in their own registry.

A registry per server (rather than prometheus_client's global one) lets several servers
live in one process, as they do in the tests, without clashing metric names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from updraft.serve.wire import CoreStats

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        registry = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, registry=registry, labelnames=["model_name"]).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            metric = Counter(name, doc, registry=registry, labelnames=["model_name"])
            return metric.labels(**labels)

        def histogram(name: str, doc: str) -> Histogram:
            metric = Histogram(
                name, doc, registry=registry, labelnames=["model_name"], buckets=LATENCY_BUCKETS
            )
            return metric.labels(**labels)

        self.requests_running = gauge("updraft_num_requests_running", "Requests in the batch.")
        self.requests_waiting = gauge(
            "updraft_num_requests_waiting", "Requests queued for the batch."
        )
        self.kv_blocks_used = gauge("updraft_kv_cache_used_blocks", "KV cache blocks in use.")
        self.kv_blocks_total = gauge("updraft_kv_cache_total_blocks", "KV cache blocks in all.")
        self.kv_usage = gauge("updraft_kv_cache_usage_ratio", "Fraction of KV blocks in use.")
        self.prompt_tokens = counter("updraft_prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter("updraft_generation_tokens", "Tokens generated.")
        self.time_to_first_token = histogram(
            "updraft_time_to_first_token_seconds", "From arrival to the first token."
        )
        self.inter_token_latency = histogram(
            "updraft_inter_token_latency_seconds", "Between consecutive tokens of a request."
        )
        self.request_latency = histogram(
            "updraft_e2e_request_latency_seconds", "From arrival to the last output."
        )
        self.requests_finished = Counter(
            "updraft_request_finished",
            "Finished requests by finish reason.",
            registry=registry,
            labelnames=["model_name", "finish_reason"],
        )
        self.requests_rejected = Counter(
            "updraft_request_rejected",
            "Requests answered with an error status (4xx or 5xx), by status.",
            registry=registry,
            labelnames=["model_name", "status"],
        )
        self.drafts_proposed = Gauge(
            "updraft_spec_decode_draft_tokens",
            "Draft tokens offered for verification since start, by draft position.",
            registry=registry,
            labelnames=["model_name", "position"],
        )
        self.drafts_accepted = Gauge(
            "updraft_spec_decode_accepted_tokens",
            "Draft tokens accepted since start, by draft position.",
            registry=registry,
            labelnames=["model_name", "position"],
        )
        self._model_name = model_name

    def publish(self, stats: CoreStats) -> None:
        self.requests_running.set(stats.num_running)
        self.requests_waiting.set(stats.num_waiting)
        self.kv_blocks_used.set(stats.kv_blocks_used)
        self.kv_blocks_total.set(stats.kv_blocks_total)
        self.kv_usage.set(stats.kv_blocks_used / max(stats.kv_blocks_total, 1))
        for gauge, counts in (
            (self.drafts_proposed, stats.drafts_proposed),
            (self.drafts_accepted, stats.drafts_accepted),
        ):
            for position, count in enumerate(counts):
                gauge.labels(model_name=self._model_name, position=str(position)).set(count)

    def finished(self, reason: str) -> None:
        self.requests_finished.labels(model_name=self._model_name, finish_reason=reason).inc()

    def rejected(self, status: int) -> None:
        self.requests_rejected.labels(model_name=self._model_name, status=str(status)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
