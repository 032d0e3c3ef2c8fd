"""Workers on tiny random models, started in the test process on free localhost ports."""

from __future__ import annotations

import urllib.request
from contextlib import asynccontextmanager

from prometheus_client.parser import text_string_to_metric_families

from workers.engine.engine import Engine
from workers.rpc.client import GrpcBackend
from workers.rpc.server import WorkerServer
from workers.rpc.service import serve_role
from workers.worker import WorkerSettings


def settings(role: str, **overrides) -> WorkerSettings:
    fields = dict(host="127.0.0.1", port=0, metrics_port=0, health_port=0, drain_s=0.0)
    return WorkerSettings(role=role, **{**fields, "insecure": True, **overrides})


@asynccontextmanager
async def worker(role: str, engine: Engine | None, streaming: bool = True, **overrides):
    """A served worker and a GrpcBackend dialled to it; engine None = an n-gram draft;
    `streaming` False: the backend sends Verify calls, not stream messages."""
    server = await serve_role(role, engine, settings(role, **overrides))
    try:
        address = f"127.0.0.1:{server.port}"
        async with GrpcBackend(role, address, streaming=streaming) as backend:
            yield server, backend
    finally:
        await server.shutdown(0)


def target_worker(engine: Engine, streaming: bool = True, **overrides):
    return worker("target", engine, streaming, **overrides)


def draft_worker(engine: Engine | None, **overrides):
    return worker("draft", engine, **overrides)


def scrape(server: WorkerServer) -> dict[str, list]:
    """The worker's /metrics, as {sample name: [(labels, value), ...]}."""
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples
