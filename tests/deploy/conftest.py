"""Shared pieces of the deploy-kit tests: paths, tools, metric names, one live server.

The embedded tests (Prometheus scraping, Locust: test_live.py) share one
`specsplit serve` on SmolLM2 with the in-gateway n-gram draft; it lives as long
as that module, so no idle server stays behind for the rest of the suite.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

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
    found = shutil.which("prometheus")
    if found:
        return found
    if shutil.which("apt-get") is None:
        pytest.skip("prometheus is not installed and there is no apt-get to install it")
    if os.geteuid() != 0:
        pytest.skip("prometheus is not installed; `apt-get install prometheus` needs root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    apt = ["apt-get", "-o", "DPkg::Lock::Timeout=300", "-q"]
    install = [*apt, "install", "-y", "--no-install-recommends", "prometheus"]

    def run(command):
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)

    result = run(install)
    if result.returncode != 0:  # no package lists yet, or stale ones
        update = run([*apt, "update"])
        if update.returncode != 0:
            pytest.skip(f"apt-get update failed (no network?): {update.stderr.strip()[-500:]}")
        result = run(install)
    found = shutil.which("prometheus")
    assert found, f"apt-get install prometheus failed:\n{result.stdout[-2000:]}{result.stderr}"
    return found
