"""Prometheus metrics of one worker, in a registry of its own (no global state).

Every metric carries a `role` label (draft / target). Rates are PromQL over
the histograms' _count and _sum, e.g. mean batch size:
    rate(specsplit_worker_batch_size_sum[1m]) / rate(specsplit_worker_batch_size_count[1m])
and errors by code:
    sum by (code) (rate(specsplit_worker_requests_total{code!="OK"}[1m]))
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from proto.specsplit.v1 import specsplit_pb2 as pb
from workers.engine.batch import SlotInput
from workers.engine.sessions import SessionTable
from workers.rpc.batcher import BatchReport
from workers.rpc.status import CODES

SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
SERVICE_OF = {"draft": "DraftService", "target": "TargetService"}  # in specsplit.proto
# the codes a call can end with (workers/rpc/status.py), whose series start at 0
KNOWN_CODES = (
    "OK",
    *(code.name for code in CODES.values()),
    "INTERNAL",
    "CANCELLED",
    "UNAVAILABLE",
)
SECOND_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class SessionCollector(Collector):
    """Live sessions, LRU evictions and prefix cache hits, read from the session table at
    scrape time."""

    def __init__(self, role: str, table: SessionTable):
        self.role = role
        self.table = table

    def collect(self):
        live = GaugeMetricFamily(
            "specsplit_worker_live_sessions", "Sessions the worker holds now", labels=["role"]
        )
        live.add_metric([self.role], len(self.table))
        evictions = CounterMetricFamily(
            "specsplit_worker_evictions",
            "Sessions evicted (least recently used) to make room for a new one",
            labels=["role"],
        )
        evictions.add_metric([self.role], self.table.evictions)
        prompts = CounterMetricFamily(
            "specsplit_worker_prompt_tokens",
            "History tokens sessions (re)started from, and of those, tokens found cached",
            labels=["role", "source"],
        )
        prompts.add_metric([self.role, "sent"], self.table.restart_tokens)
        prompts.add_metric([self.role, "cached"], self.table.hit_tokens)
        cache = self.table.cache
        cached = GaugeMetricFamily(
            "specsplit_worker_prefix_cache_tokens",
            "KV positions in blocks shared by prefix (held by sessions or idle)",
            labels=["role"],
        )
        cached.add_metric([self.role], 0 if cache is None else cache.cached_tokens)
        return [live, evictions, prompts, cached]


class WorkerMetrics:
    def __init__(self, role: str, prompt_share: float = 1.0):
        self.role = role
        # the tokens the engine's forwards have fed, all told, in tokens fed for their
        # logits: a token fed without them (a prompt's) counts `prompt_share` of one
        # (NativeLlama.prompt_token_share)
        self.fed_work = 0.0
        self.prompt_share = prompt_share
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["role"]
        self.batch_size = Histogram(
            "specsplit_worker_batch_size",
            "Calls (sessions) merged into one batch step",
            labels,
            buckets=SIZE_BUCKETS,
            registry=r,
        ).labels(role)
        self.tokens_per_forward = Histogram(
            "specsplit_worker_tokens_per_forward",
            "Tokens fed to the model in one forward, over all sessions in it",
            labels,
            buckets=TOKEN_BUCKETS,
            registry=r,
        ).labels(role)
        self.forward_seconds = Histogram(
            "specsplit_worker_forward_seconds",
            "Duration of one batch step on the engine thread",
            labels,
            buckets=SECOND_BUCKETS,
            registry=r,
        ).labels(role)
        self.queue_seconds = Histogram(
            "specsplit_worker_queue_seconds",
            "Time a call waited between arrival and the start of its batch",
            labels,
            buckets=SECOND_BUCKETS,
            registry=r,
        ).labels(role)
        self.requests = Counter(
            "specsplit_worker_requests",
            "Finished calls by method and gRPC status code (each call a VerifyBatch carried "
            "counts as a Verify call too)",
            ["role", "method", "code"],
            registry=r,
        )
        for method in pb.DESCRIPTOR.services_by_name[SERVICE_OF[role]].methods:
            for code in KNOWN_CODES:  # at 0 from the start, so rate() sees the first error
                self.requests.labels(role, method.name, code)

    def watch_sessions(self, table: SessionTable) -> None:
        self.registry.register(SessionCollector(self.role, table))

    def observe_batch(self, report: BatchReport) -> None:
        self.batch_size.observe(report.size)
        self.forward_seconds.observe(report.forward_ns / 1e9)
        for ns in report.queue_ns:
            self.queue_seconds.observe(ns / 1e9)

    def observe_request(self, method: str, code: str) -> None:
        self.requests.labels(self.role, method, code).inc()

    def observe_forward(self, rows: list[SlotInput]) -> None:
        tokens = sum(len(r.tokens) for r in rows)
        logits = sum(r.logits_for for r in rows)
        self.fed_work += logits + self.prompt_share * (tokens - logits)
        self.tokens_per_forward.observe(tokens)

    def serve(self, host: str, port: int):
        """Starts the /metrics HTTP server; returns (server, thread); port 0 = any free port."""
        return start_http_server(port, addr=host, registry=self.registry)


class MeteredEngine:
    """An Engine whose every forward is also reported (tokens per forward)."""

    def __init__(self, engine, on_forward: Callable[[list[SlotInput]], None]):
        self._engine = engine
        self._on_forward = on_forward

    def forward(self, rows: list[SlotInput]):
        self._on_forward(rows)
        return self._engine.forward(rows)

    def run(self, rows: list[SlotInput], features=None, kept: bool = False):
        self._on_forward(rows)
        return self._engine.run(rows, features, kept)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)
