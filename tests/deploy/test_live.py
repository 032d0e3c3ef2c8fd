"""The deploy kit against a live `specsplit serve` (SmolLM2, the in-gateway n-gram
draft), shared by this module's tests:

  - a real Prometheus (Debian's, installed by the prometheus_binary fixture when
    missing) scrapes the gateway and the target worker every second while
    OpenAI-SDK traffic runs, then every panel query of every dashboard must
    return data through its HTTP API;
  - `make loadtest` runs Locust headless for about 20 seconds with no failure,
    and its CSV reports time to first token and tokens/s from the streams.
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from openai import NotFoundError, OpenAI

from tests.deploy.conftest import REPO
from tests.deploy.test_dashboards import concrete, queries
from tests.gateway.helpers import free_port

pytestmark = pytest.mark.embedded

SCRAPE_S = 1
VENV = Path(sys.prefix)  # the Makefile's $(VENV): its bin/locust is this venv's
LIST_PROMPT = (
    "Here is a list: apple, banana, cherry, date, elderberry, fig, grape. "
    "Repeat the list exactly, then stop."
)


# --- a real Prometheus ---------------------------------------------------------------


class Prometheus:
    """A Prometheus server on loopback scraping the given targets every second."""

    def __init__(self, binary: str, directory, targets: dict[str, list[str]]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {
                "scrape_interval": f"{SCRAPE_S}s",
                "scrape_timeout": f"{SCRAPE_S}s",
                "evaluation_interval": f"{SCRAPE_S}s",
            },
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": addresses}]}
                for job, addresses in targets.items()
            ],
        }
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(directory / "prometheus.log", "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={directory / 'prometheus.yml'}",
                f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.directory = directory

    def query(self, expr: str) -> list[dict]:
        reply = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = reply.json()
        assert reply.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
        return body["data"]["result"]

    def wait(self, condition, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, (self.directory / "prometheus.log").read_text()
            try:
                if condition():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise AssertionError(f"Prometheus: no {what} after {timeout} s")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def counter(url: str, name: str) -> float:
    """The sum of a metric's samples, straight from a /metrics endpoint."""
    text = httpx.get(url, timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name)] in " {"
    )


def send_traffic(base_url: str) -> None:
    """A few OpenAI-SDK requests of every kind, streaming and not, and one 404."""
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    for prompt in (LIST_PROMPT, "Repeat exactly: the cat sat on the mat."):
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=32,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        assert any(chunk.usage for chunk in stream)
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": LIST_PROMPT}], max_tokens=24
    )
    assert reply.usage.completion_tokens > 0
    reply = client.completions.create(model=model, prompt="One, two, three, four,", max_tokens=12)
    assert reply.usage.completion_tokens > 0
    stream = client.completions.create(
        model=model, prompt="The cat sat on the mat. The cat", max_tokens=12, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    with pytest.raises(NotFoundError):  # an error status for the error panels
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )


@pytest.fixture(scope="module")
def scraped(live_serve, prometheus_binary, tmp_path_factory):
    """Prometheus scraping the live gateway and worker, after traffic has been recorded."""
    serve, worker_ports = live_serve
    base_url = serve.state["url"]
    gateway = base_url.removeprefix("http://").removesuffix("/v1")
    workers = [f"127.0.0.1:{port}" for port in worker_ports.values()]
    prometheus = Prometheus(
        prometheus_binary,
        tmp_path_factory.mktemp("prometheus"),
        {"specsplit-gateway": [gateway], "specsplit-workers": workers},
    )
    try:
        prometheus.wait(
            lambda: httpx.get(f"{prometheus.url}/-/ready", timeout=5).status_code == 200,
            60,
            "readiness",
        )
        targets = 1 + len(workers)
        prometheus.wait(lambda: len(prometheus.query("up == 1")) == targets, 60, "every target up")
        time.sleep(2 * SCRAPE_S)  # samples from before the traffic, so rates have a start
        send_traffic(base_url)
        target = f"127.0.0.1:{worker_ports['target']}"
        for address, name in (
            (gateway, "specsplit_generation_tokens_total"),
            (target, "specsplit_worker_batch_size_count"),
        ):  # wait until Prometheus has scraped what the traffic left behind
            value = counter(f"http://{address}/metrics", name)
            prometheus.wait(
                lambda n=name, v=value: any(
                    float(r["value"][1]) >= v for r in prometheus.query(f"sum({n})")
                ),
                30,
                f"{name} at {value}",
            )
        time.sleep(2 * SCRAPE_S)
        yield prometheus
    finally:
        prometheus.stop()


@pytest.mark.parametrize(
    "dashboard, title, exprs", queries(), ids=[f"{d}:{t}" for d, t, _ in queries()]
)
def test_every_panel_returns_data(scraped, dashboard, title, exprs):
    values = []
    for expr in exprs:
        result = scraped.query(concrete(expr))
        assert result, f"{dashboard} / {title}: no data for {concrete(expr)}"
        values += [float(r["value"][1]) for r in result]
    assert any(math.isfinite(v) for v in values), f"{dashboard} / {title}: only NaN ({values})"


# --- Locust ------------------------------------------------------------------------


def final_stats(path: Path) -> dict[str, dict]:
    """Locust's final totals by row name (its CSV files are once-a-second snapshots)."""
    return {entry["name"]: entry for entry in json.loads(path.read_text())}


def test_make_loadtest_runs_headless_without_failures(live_serve, tmp_path):
    serve, _ = live_serve
    host = serve.state["url"].removesuffix("/v1")
    command = [
        "make",
        "--no-print-directory",
        "-o",
        f"{VENV}/.specsplit-installed",  # the venv is there already: install nothing
        "loadtest",
        f"VENV={VENV}",
        f"URL={host}",
        "USERS=2",
        "DURATION=20s",
        f"RESULTS={tmp_path}",
        "ARGS=--max-tokens 16 --only-summary",
    ]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240)
    output = result.stdout[-4000:] + result.stderr[-4000:]
    assert result.returncode == 0, output
    assert (tmp_path / "report.html").stat().st_size > 0
    assert (tmp_path / "specsplit_stats.csv").stat().st_size > 0
    stats = final_stats(tmp_path / "specsplit.json")
    assert sum(entry["num_failures"] for entry in stats.values()) == 0, output
    for name in ("TTFT chat", "E2E chat", "tokens/s chat", "tokens/s completions"):
        assert stats.get(name, {}).get("num_requests", 0) > 0, f"{name} missing:\n{output}"
    assert stats["TTFT chat"]["total_response_time"] > 0, output
    assert any(name.startswith("chat stream (") for name in stats)
    assert any(name.startswith("completions (") for name in stats)
    with open(tmp_path / "specsplit_failures.csv", newline="") as f:
        assert len(list(csv.reader(f))) <= 1, output  # the header alone
