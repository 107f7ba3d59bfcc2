"""Prometheus metrics of the server, in their own registry.

A registry per server (rather than prometheus_client's global one) lets several servers
live in one process, as they do in the tests, without clashing metric names.

With several API processes (``--api-server-count``), each would count only its own
requests. The supervising process then gives them one directory (``shared_directory``)
and prometheus_client's multiprocess mode: every process writes its values to files
there, and any of them answers /metrics with what all hold, counters and histograms
summed. The engine's gauges reach every API process alike (each step's CoreStats);
the most recent value of a live process is the one shown.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

if TYPE_CHECKING:
    from updraft.serve.wire import CoreStats

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip

CONTENT_TYPE = CONTENT_TYPE_LATEST

# prometheus_client reads it when it is first imported: a process started with it set
# (the API processes, spawned) keeps its metrics in files there.
MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"
# Gauges that mirror the engine's state: the latest value any live process was sent.
ENGINE_GAUGE_MODE = "livemostrecent"


def shared_directory(directory: str) -> str:
    """Make ``directory`` (new, under one the caller removes at exit) the metrics files'
    home for the API processes this process starts from now on."""
    Path(directory).mkdir(mode=0o700)
    os.environ[MULTIPROCESS_ENV] = directory
    return directory


def process_gone(pid: int) -> None:
    """An API process exited: its gauges stop counting (its counters still do)."""
    directory = os.environ.get(MULTIPROCESS_ENV)
    if directory is not None and os.path.isdir(directory):
        mark_process_dead(pid, directory)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        registry = self.registry

        def gauge(name: str, doc: str, *by: str) -> Gauge:
            mode = ENGINE_GAUGE_MODE
            metric = Gauge(
                name, doc, ["model_name", *by], registry=registry, multiprocess_mode=mode
            )
            return metric if by else metric.labels(**labels)

        def counter(name: str, doc: str, *by: str) -> Counter:
            metric = Counter(name, doc, ["model_name", *by], registry=registry)
            return metric if by else metric.labels(**labels)

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
        self.requests_finished = counter(
            "updraft_request_finished", "Finished requests by finish reason.", "finish_reason"
        )
        self.requests_rejected = counter(
            "updraft_request_rejected",
            "Requests answered with an error status (4xx or 5xx), by status.",
            "status",
        )
        self.drafts_proposed = gauge(
            "updraft_spec_decode_draft_tokens",
            "Draft tokens offered for verification since start, by draft position.",
            "position",
        )
        self.drafts_accepted = gauge(
            "updraft_spec_decode_accepted_tokens",
            "Draft tokens accepted since start, by draft position.",
            "position",
        )
        self._model_name = model_name
        # Files only where this process's values went to them (it was started so).
        in_files = values.ValueClass is not values.MutexValue
        self._shared = os.environ.get(MULTIPROCESS_ENV) if in_files else None

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
        if self._shared is None:
            return generate_latest(self.registry)
        every_process = CollectorRegistry()
        MultiProcessCollector(every_process, self._shared)
        return generate_latest(every_process)
