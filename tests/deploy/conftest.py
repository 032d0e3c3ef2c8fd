"""Shared pieces of the deploy-kit tests: paths, tools, metric names, one live server.

The embedded tests (Prometheus scraping, Locust: test_live.py) share one
`specsplit serve` on SmolLM2 with the in-gateway n-gram draft; it lives as long
as that module, so no idle server stays behind for the rest of the suite.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from tests.debian import debian_tool

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the venv's bin: kubectl, hadolint, locust come with it


def tool(name: str) -> str:
    """A command-line tool from this venv (the dev extra), else from PATH."""
    found = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found: install the dev extra (pip install -e '.[dev]')")
    return found


def sample_names(registry: CollectorRegistry) -> set[str]:
    """Every series name a registry exposes, labelled metrics without children included."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_count", "_sum", "_created"),
        "summary": ("_count", "_sum", "_created"),
        "gauge": ("",),
    }
    names = set()
    for family in registry.collect():
        names |= {family.name + s for s in suffixes.get(family.type, ("",))}
        names |= {s.name for s in family.samples}
    return names


def exported_metric_names() -> set[str]:
    """The names the gateway and a worker of each role export, from the code itself."""
    from gateway.metrics import Metrics
    from workers.engine.sessions import SessionTable
    from workers.rpc.metrics import WorkerMetrics

    names = sample_names(Metrics().registry)
    for role in ("draft", "target"):
        worker = WorkerMetrics(role)
        worker.watch_sessions(SessionTable(1))
        names |= sample_names(worker.registry)
    return names


WORKER_LINE = re.compile(r"(draft|target) worker serving .* \(metrics on port (\d+)\)")


@pytest.fixture(scope="module")
def live_serve(tmp_path_factory):
    """`specsplit serve` (one target worker, n-gram draft in the gateway) for one module.

    Yields (serve, worker_metrics) where worker_metrics maps the worker's role to
    its /metrics port (serve starts workers with --metrics-port 0; each logs its port).
    """
    from tests.gateway.test_serve import Serve

    server = Serve(tmp_path_factory.mktemp("deploy-serve"), "--targets", "1")
    server.wait_ready()
    try:
        ports = {}
        for line in server.lines:
            match = WORKER_LINE.search(line)
            if match:
                ports[match.group(1)] = int(match.group(2))
        assert "target" in ports, "no metrics port in the worker's log:\n" + "".join(server.lines)
        yield server, ports
    finally:
        assert server.stop() == 0


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    """Prometheus from Debian's package, installed with apt-get when it is not on PATH."""
    return debian_tool("prometheus")
