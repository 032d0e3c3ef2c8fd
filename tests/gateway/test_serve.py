"""`specsplit serve`: real worker processes, real gRPC, the openai client.

The embedded tests share one server on SmolLM2 (two target workers, the
in-gateway n-gram draft); the target-killing one runs last. The last test
runs serve on tiny models with a draft worker.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch
from openai import OpenAI

import gateway.serve as serve_module
from gateway.serve import ServeSettings, free_ports, worker_options, worker_settings
from tests.gateway.helpers import free_port, wait_until
from workers.protocol import WorkerDown
from workers.rpc.client import GrpcBackend
from workers.rpc.security import client_of
from workers.settings import EMBEDDED_MODEL, to_argv

MODEL = EMBEDDED_MODEL
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
STORY = [{"role": "user", "content": "Tell me a short story about a cat and a dog."}]


class Serve:
    """`specsplit serve` in a subprocess; its output is drained by a thread."""

    def __init__(self, tmp_path, *args: str):
        self.port = free_port()
        self.state_file = tmp_path / "serve-state.json"
        command = [sys.executable, "-m", "workers.tools.cli", "serve", "--port", str(self.port)]
        command += ["--state-file", str(self.state_file), "--health-interval-s", "0.5"]
        command += ["--parent-pid", str(os.getpid()), *args]  # a killed test run takes it along
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self.drain, daemon=True).start()

    def drain(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)
            if line.startswith("SpecSplit ready: "):
                self.ready.set()

    def wait_ready(self, timeout: float = 240) -> None:
        if not self.ready.wait(timeout):
            self.stop()
            raise AssertionError("serve did not get ready:\n" + "".join(self.lines[-40:]))

    @property
    def state(self) -> dict:
        return json.loads(self.state_file.read_text())

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(60)


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    # the killed target stays down (no restart within the module): tests/chaos has the restart.
    # No suffix cache: the kill test repeats a greedy request, which would draft its whole
    # answer from the first one's output and could end before the 4th chunk. One drafting
    # epoch all along (gateway/epochs.py): the metrics test counts drafts, which a plain
    # epoch, reached 4 s after the first rounds by a slow enough suite, would not send
    server = Serve(
        tmp_path_factory.mktemp("serve"),
        *("--targets", "2", "--restart-backoff-s", "600", "--suffix-cache-tokens", "0"),
        *("--adaptive-epoch-s", "3600"),
    )
    server.wait_ready()
    yield server
    pids = [w["pid"] for w in server.state["workers"]]
    assert server.stop() == 0
    for pid in pids:  # every worker is gone with it
        wait_until(lambda pid=pid: not alive(pid), 30, f"worker {pid} to exit")


@pytest.fixture(scope="module")
def client(serve) -> OpenAI:
    return OpenAI(base_url=serve.state["url"], api_key="unused", max_retries=0, timeout=120)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().split()[2] != "Z"


def live_sessions(serve: Serve, address: str) -> int:
    """Asks the worker itself, over the mutual TLS channel serve made for its gateway."""

    async def ask() -> int:
        backend = GrpcBackend("target", address, security=client_of(Path(serve.state["tls"])))
        try:
            return (await backend.info()).live_sessions
        finally:
            await backend.close()

    return asyncio.run(ask())


def answers_plaintext(role: str, address: str) -> bool:
    async def ask() -> bool:
        async with GrpcBackend(role, address, 5.0) as backend:
            try:
                await backend.info()
            except WorkerDown:
                return False
            return True

    return asyncio.run(ask())


def stream_text(client, on_chunk=None, **kw) -> str:
    text = ""
    stream = client.chat.completions.create(model=MODEL, stream=True, **kw)
    for i, chunk in enumerate(stream):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if on_chunk is not None:
            on_chunk(i)
    return text


@pytest.mark.embedded
def test_the_gateway_and_each_worker_freeze_their_start_up_heap(serve):
    # gc.freeze once started: a full collection then skips the model, tokenizer and app
    frozen = [line for line in serve.lines if "start-up objects frozen" in line]
    assert sum(" gateway: " in line for line in frozen) == 1
    assert sum(" target worker: " in line for line in frozen) == 2 and len(frozen) == 3
    counts = [int(line.split(": ")[-1].split()[0]) for line in frozen]
    assert all(count > 10_000 for count in counts), frozen


@pytest.mark.embedded
def test_the_gateway_and_each_worker_run_on_uvloop(serve):
    # libuv's loop in every process, and httptools parsing the gateway's HTTP
    loops = [line for line in serve.lines if ": event loop " in line]
    assert sum(" gateway: event loop uvloop, HTTP HttpToolsProtocol" in line for line in loops) == 1
    assert sum(line.endswith(" target worker: event loop uvloop\n") for line in loops) == 2, loops
    assert len(loops) == 3, loops


def test_greedy_chat_equals_transformers(client, embedded_hf, embedded_tokenizer):
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=24, temperature=0
    )
    prompt = embedded_tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=False
    )
    ids = embedded_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = embedded_hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
    expected = embedded_tokenizer.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True)
    assert reply.choices[0].message.content == expected
    assert "Paris" in expected


@pytest.mark.embedded
def test_disconnected_client_leaves_no_live_sessions(serve, client):
    stream = client.chat.completions.create(
        model=MODEL, messages=STORY, max_tokens=200, temperature=0, stream=True
    )
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    addresses = [w["address"] for w in serve.state["workers"] if w["role"] == "target"]
    assert sum(live_sessions(serve, a) for a in addresses) == 1
    stream.close()
    wait_until(lambda: sum(live_sessions(serve, a) for a in addresses) == 0, 30, "sessions to end")


@pytest.mark.embedded
def test_metrics_after_traffic(serve, client):
    # 64 tokens: enough rounds for the n-gram draft to find a match the target accepts (a
    # round without a draft decodes up to four tokens, and looks up none between them)
    client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=64, temperature=0)
    text = httpx.get(serve.state["url"].removesuffix("/v1") + "/metrics").text
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert values["specsplit_draft_tokens_total"] > 0
    assert values["specsplit_accepted_tokens_total"] > 0
    assert values["specsplit_time_to_first_token_seconds_count"] > 0
    assert values["specsplit_verify_steps_total"] > 0


@pytest.mark.embedded
def test_killing_a_target_mid_stream_loses_nothing(serve, client):
    kw = dict(messages=STORY, max_tokens=48, temperature=0)
    clean = stream_text(client, **kw)
    targets = {w["address"]: w["pid"] for w in serve.state["workers"] if w["role"] == "target"}
    killed = []

    def kill_busy_target(i: int) -> None:
        if i == 4 and not killed:
            busy = next(a for a in targets if live_sessions(serve, a) > 0)
            os.kill(targets[busy], signal.SIGKILL)
            killed.append(busy)

    faulted = stream_text(client, on_chunk=kill_busy_target, **kw)
    assert killed
    assert faulted == clean
    metrics = httpx.get(serve.state["url"].removesuffix("/v1") + "/metrics").text
    assert f'specsplit_worker_up{{address="{killed[0]}",role="target"}} 0.0' in metrics
    assert 'specsplit_failovers_total{role="target"} 1.0' in metrics


def test_serve_with_draft_workers_on_tiny_models_and_ctrl_c(tmp_path, tiny_dir, tiny_draft_dir):
    """Not embedded: a tiny target and a tiny draft worker over gRPC; Ctrl-C stops everything."""
    server = Serve(
        tmp_path,
        "--target-model",
        str(tiny_dir),
        "--served-model-name",
        "tiny",
        "--draft-model",
        str(tiny_draft_dir),
    )
    try:
        server.wait_ready(120)
        roles = sorted(w["role"] for w in server.state["workers"])
        assert roles == ["draft", "target"]
        for w in server.state["workers"]:  # serve's channel is TLS: plaintext gets nothing
            assert not answers_plaintext(w["role"], w["address"])
        client = OpenAI(base_url=server.state["url"], api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "one two three"}],
            max_tokens=24,
            temperature=0,
            extra_body={"speculation_stats": True},
        )
        stats = reply.model_extra["speculation_stats"]
        assert stats["accepted_tokens"] > 0 and stats["degraded_rounds"] == 0
        pids = [w["pid"] for w in server.state["workers"]]
    finally:
        server.process.send_signal(signal.SIGINT)
        code = server.process.wait(60)
    assert code == 0
    for pid in pids:
        wait_until(lambda pid=pid: not alive(pid), 30, f"worker {pid} to exit")


def test_serve_ends_at_once_when_its_parent_has_gone():
    """--parent-pid (what the test harness and the bench pass): serve gets SIGTERM when that
    process ends (`die_with`, tests/workers/test_lifecycle.py), and before it starts anything
    when the process is not its parent any more."""
    command = [sys.executable, "-m", "workers.tools.cli", "serve", "--parent-pid", "1"]
    orphan = subprocess.run(command, capture_output=True, timeout=120)
    assert orphan.returncode == -signal.SIGTERM
    assert b"SpecSplit ready" not in orphan.stdout


def test_every_worker_option_of_serve_reaches_the_workers_it_starts():
    """`serve --worker-X V` starts workers with `--X V`, for every such option (each set
    away from its default here, so a dropped one shows)."""
    options = worker_options()
    assert {"worker_max_sessions", "worker_prefix_state_mib", "worker_prefix_caching"} <= set(
        options
    )
    changed = {}
    for name in options:
        default = ServeSettings.model_fields[name].default
        changed[name] = (not default) if isinstance(default, bool) else default + 3
    s = ServeSettings(**changed)
    worker = worker_settings("target", MODEL, s, None, port=50051)
    assert {n: getattr(worker, n.removeprefix("worker_")) for n in options} == changed
    argv = to_argv(worker, ("role",))
    assert "--prefix-state-mib" in argv
    assert argv[argv.index("--prefix-state-mib") + 1] == str(changed["worker_prefix_state_mib"])


def test_worker_ports_are_distinct_and_never_the_gateways():
    """A port is free only when it is chosen: serve's gateway binds its own while the workers
    still load, so the workers' ports skip it (a bench's serve was handed its `--port` for
    a worker once), and each is held until all are chosen, so none comes twice."""
    (gateway,) = free_ports(1)
    ports = free_ports(32, {gateway})
    assert len(set(ports)) == 32 and gateway not in ports


def test_a_port_the_system_hands_out_again_is_skipped_when_taken(monkeypatch):
    handed = iter([8000, 8001, 8002])  # the system hands out the gateway's port first

    class Socket(socket.socket):
        def bind(self, address):
            super().bind((address[0], 0))
            self.port = next(handed)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(serve_module.socket, "socket", Socket)
    assert free_ports(2, {8000}) == [8001, 8002]
