"""`specsplit serve`: workers and gateway together on this machine.

    specsplit serve                                  # SmolLM2 target, n-gram draft
    specsplit serve --targets 2 --draft-model smollm2-135m-draft --drafts 1

Starts `--targets` target workers (and `--drafts` draft workers for a model
draft) as child processes (`specsplit worker ...` on free ports), then the
gateway in this process; prints `SpecSplit ready: http://HOST:PORT/v1` once
every worker is serving. Ctrl-C or SIGTERM drains the gateway first (/health
and new requests get 503 while the requests in flight finish, up to
`--drain-timeout-s`), then stops the workers and exits 0; a second signal
stops at once. Children also die with this process (PR_SET_PDEATHSIG, --parent-pid) if it
is killed.

`--draft-model ngram` (the default) runs the prompt-lookup draft inside the
gateway: it needs nothing but the history the gateway already owns, so a
draft worker would only add a network hop per round and a process to run.
`--draft-model none` decodes with the target alone. Any other value is a model
for the draft workers: a small LM, or an EAGLE head directory (a feature draft,
workers/engine/eagle.py), which the workers recognise by its specsplit_draft.json.

The gateway and its workers talk mutual TLS with a token: a fresh CA,
certificates and token are written to a private temporary directory at every
start and removed at exit (`--insecure` for plaintext).

A worker process that exits is started again on its address with the same
credentials, after a backoff (`--restart-backoff-s` 1 s, doubling at each
exit in a row up to `--restart-backoff-max-s` 30 s; a worker up
`--restart-stable-s` 60 s starts over at 1 s), and rejoins its pool at its
next health check (gateway/supervise.py). Supervision stops when the drain
starts.

`--state-file PATH` writes the gateway URL, each worker's role, address
and pid, and the credentials' directory as JSON once ready and after every
restart (for tests and tooling; off by default).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection
from pathlib import Path

import uvicorn
from pydantic import Field

from gateway.app import create_app
from gateway.main import Server, configure_logging, drain_and_stop, stop_on_signals
from gateway.settings import GatewayOptions, GatewaySettings
from gateway.supervise import Backoff, Child, Supervisor
from workers.rpc.security import issue
from workers.settings import EngineOptions, parse, settings_config, to_argv
from workers.worker import WorkerSettings, die_with, freeze_heap, log_runtime, run_loop

log = logging.getLogger("specsplit.serve")


class ServeSettings(GatewayOptions, EngineOptions):
    model_config = settings_config("serve")

    host: str = Field("127.0.0.1", description="address the gateway listens on")
    port: int = Field(8000, ge=0, le=65535, description="gateway port; 0 = any free port")
    draft_model: str = Field(
        "ngram",
        description="'ngram' (in the gateway), 'none', or a model or EAGLE head directory for "
        "draft workers",
    )
    targets: int = Field(1, ge=1, description="target worker processes")
    drafts: int = Field(1, ge=1, description="draft worker processes (with a draft model)")
    worker_max_sessions: int = Field(
        WorkerSettings.model_fields["max_sessions"].default,
        ge=1,
        description="sessions each worker holds at once",
    )
    worker_kv_tokens: int = Field(
        WorkerSettings.model_fields["kv_tokens"].default,
        ge=1,
        description="KV cache positions each worker shares among its sessions (paged)",
    )
    worker_prefill_chunk: int = Field(
        WorkerSettings.model_fields["prefill_chunk"].default,
        ge=0,
        description="tokens of a long prompt a target prefills per batch; 0 = all at once",
    )
    worker_prefix_caching: bool = Field(
        WorkerSettings.model_fields["prefix_caching"].default,
        description="workers share the KV blocks of a common prompt prefix between sessions",
    )
    worker_prefix_state_mib: int = Field(
        WorkerSettings.model_fields["prefix_state_mib"].default,
        ge=0,
        description="MiB of hidden states each target keeps for feature-draft sessions' cached "
        "prompt blocks (with --worker-prefix-caching); 0 = none",
    )
    worker_lookup_rows: int = Field(
        WorkerSettings.model_fields["lookup_rows"].default,
        ge=-1,
        description="a target's forward carries decode steps' own prompt-lookup drafts "
        "(--decode-lookup) while it feeds at most this many tokens; -1 = the engine's (16 on "
        "the AMX tile unit, 6 on the bfloat16 kernel's vector paths, else 1); 0 = none",
    )
    worker_lookup_long_match: int = Field(
        WorkerSettings.model_fields["lookup_long_match"].default,
        ge=0,
        description="past those rows, a decode step still looks up where the session's history "
        "agrees with its latest match over this many tokens, while the forward feeds at most "
        "32 tokens; 0 = never",
    )
    state_file: Path | None = Field(
        None, description="write the gateway URL and workers' addresses and pids here (JSON)"
    )
    startup_timeout_s: float = Field(600.0, gt=0, description="most seconds to wait for workers")
    restart_backoff_s: float = Field(
        1.0,
        gt=0,
        description="wait before restarting a worker that exited; doubles at each exit in a row",
    )
    restart_backoff_max_s: float = Field(30.0, gt=0, description="longest wait before a restart")
    restart_stable_s: float = Field(
        60.0,
        gt=0,
        description="a worker up this long counts as recovered: its next exit "
        "waits --restart-backoff-s again",
    )
    parent_pid: int | None = Field(
        None,
        description="stop (SIGTERM: drain, then stop the workers) when this process ends; Linux "
        "(for a harness that starts serve: a test run or a benchmark killed outright)",
    )
    insecure: bool = Field(
        False,
        description="plaintext between gateway and workers; default mutual TLS and a token, "
        "made fresh at every start",
    )

    @property
    def draft_workers(self) -> int:
        return 0 if self.draft_model in ("ngram", "none") else self.drafts

    @property
    def backoff(self) -> Backoff:
        return Backoff(self.restart_backoff_s, self.restart_backoff_max_s, self.restart_stable_s)

    def model_of(self, role: str) -> str:
        return self.target_model if role == "target" else self.draft_model


def free_ports(count: int, taken: Collection[int] = (), host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports free on `host` now, none of `taken`. Each socket stays bound
    until all are chosen, so the system hands none out twice; a port is only free when
    chosen, so the gateway's own (uvicorn binds it while the workers still load their
    models) goes in `taken`: a worker given it found it bound (a bench's serve that chose
    its `--port` the same way saw this)."""
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        while len(ports) < count:
            sock = held.enter_context(socket.socket())
            sock.bind((host, 0))
            if (port := sock.getsockname()[1]) not in taken:
                ports.append(port)
        return ports


WORKER_PREFIX = "worker_"  # serve's --worker-X is each worker's --X
# the settings fields that name each file `issue` writes, on each side of the channel
WORKER_FILES = dict(
    tls_cert="server.crt", tls_key="server.key", tls_client_ca="ca.crt", token_file="token"
)
GATEWAY_FILES = dict(
    worker_ca="ca.crt", worker_cert="client.crt", worker_key="client.key", worker_token_file="token"
)


def channel(tls: Path | None, files: dict[str, str]) -> dict:
    """Settings fields for the credentials in `tls`; None = plaintext."""
    if tls is None:
        return dict(insecure=True)
    return {field: tls / name for field, name in files.items()}


def worker_settings(
    role: str, model: str, s: ServeSettings, tls: Path | None, port: int
) -> WorkerSettings:
    """The settings of a worker `serve` starts: its `--worker-X` options as the worker's `--X`."""
    engine = {name: getattr(s, name) for name in EngineOptions.model_fields}
    passed = {name.removeprefix(WORKER_PREFIX): getattr(s, name) for name in worker_options()}
    return WorkerSettings(
        role=role, host="127.0.0.1", port=port, model=model, metrics_port=0, health_port=0,
        drain_s=0.0,  # the gateway stops first
        parent_pid=os.getpid(),
        **passed, **engine, **channel(tls, WORKER_FILES),
    )  # fmt: skip


def worker_options() -> list[str]:
    """`serve`'s own `worker_X` settings, each the worker's `X`."""
    own = set(ServeSettings.model_fields) - set(GatewayOptions.model_fields)
    return sorted(n for n in own - set(EngineOptions.model_fields) if n.startswith(WORKER_PREFIX))


def start_worker(role: str, model: str, s: ServeSettings, tls: Path | None, port: int) -> Child:
    """A worker process on `port`."""
    worker = worker_settings(role, model, s, tls, port)
    command = [sys.executable, "-m", "workers.tools.cli", "worker", *to_argv(worker, ("role",))]
    # a session of its own: a terminal's Ctrl-C reaches serve alone, which drains the gateway
    # before it stops the workers. No preexec_fn: Python between fork and exec is unsafe in a
    # process with gRPC threads (a restart was seen to abort there, SIGABRT), so the worker
    # sets its own PR_SET_PDEATHSIG (--parent-pid)
    process = subprocess.Popen(command, start_new_session=True)
    log.info("started %s worker pid %d on 127.0.0.1:%d", role, process.pid, port)
    return Child(role, f"127.0.0.1:{port}", process)


def stop_workers(children: list[Child], grace_s: float = 15.0) -> None:
    """SIGTERM (workers drain), then SIGKILL whoever is still there after grace_s."""
    for child in children:
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s worker pid %d did not stop: killed", child.role, child.pid)
            child.process.kill()
            child.process.wait()


def gateway_settings(
    s: ServeSettings, children: list[Child], port: int, tls: Path | None
) -> GatewaySettings:
    options = {name: getattr(s, name) for name in GatewayOptions.model_fields}
    return GatewaySettings(
        **options,
        host=s.host,
        port=port,
        target_addresses=",".join(c.address for c in children if c.role == "target"),
        draft_addresses=",".join(c.address for c in children if c.role == "draft"),
        local_draft="ngram" if s.draft_model == "ngram" else "none",
        **channel(tls, GATEWAY_FILES),
    )


def save_state(path: Path, url: str, children: list[Child], tls: Path | None) -> None:
    """The --state-file, replaced whole (a reader never sees half of it)."""
    workers = [c.summary() for c in children]
    state = {"url": url, "pid": os.getpid(), "workers": workers, "tls": str(tls or "")}
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(state, indent=2))
    partial.replace(path)


async def wait_ready(app, server: Server, children: list[Child], stop: asyncio.Event, timeout_s):
    """True once every worker serves; False on a stop signal; raises when a worker exits."""
    deadline = time.monotonic() + timeout_s
    while not stop.is_set():
        for child in children:
            if child.process.poll() is not None:
                raise RuntimeError(
                    f"{child.role} worker pid {child.pid} exited with {child.process.returncode}"
                )
        gateway = getattr(app.state, "gateway", None)
        if server.started and gateway is not None:
            pools = [p for p in (gateway.router.targets, gateway.router.drafts) if p is not None]
            if all(w.serving for p in pools for w in p.workers.values()):
                return True
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers not serving after {timeout_s:.0f} s")
        await asyncio.sleep(0.2)
    return False


async def serve(s: ServeSettings) -> int:
    stop, cut = asyncio.Event(), asyncio.Event()
    stop_on_signals(stop, cut)
    children: list[Child] = []
    credentials = contextlib.ExitStack()
    tls = None
    if not s.insecure:
        tls = Path(credentials.enter_context(tempfile.TemporaryDirectory(prefix="specsplit-")))
        issue(tls, ["127.0.0.1", "localhost"])
    try:
        port = s.port or free_ports(1, host=s.host)[0]
        roles = ["target"] * s.targets + ["draft"] * s.draft_workers
        for role, at in zip(roles, free_ports(len(roles), {port}), strict=True):
            children.append(start_worker(role, s.model_of(role), s, tls, at))
        app = create_app(gateway_settings(s, children, port, tls))
        config = uvicorn.Config(
            app, host=s.host, port=port, log_level=s.log_level.lower(), timeout_graceful_shutdown=5
        )
        server = Server(config)
        serving = asyncio.create_task(server.serve())
        try:
            ready = await wait_ready(app, server, children, stop, s.startup_timeout_s)
        except RuntimeError as error:
            log.error("%s", error)
            server.should_exit = True
            await serving
            return 1
        url = f"http://{s.host}:{port}/v1"

        def write_state() -> None:
            if s.state_file is not None:
                save_state(s.state_file, url, children, tls)

        def restart(child: Child) -> Child:
            port = int(child.address.rsplit(":", 1)[1])
            return start_worker(child.role, s.model_of(child.role), s, tls, port)

        supervisor = Supervisor(
            children, restart, s.backoff, app.state.metrics.worker_restarts, write_state
        )
        if ready:
            freeze_heap("gateway")
            log_runtime("gateway", config.http_protocol_class.__name__)
            write_state()
            print(f"SpecSplit ready: {url}", flush=True)
            supervisor.start()
        await asyncio.wait(
            [serving, asyncio.create_task(stop.wait())], return_when="FIRST_COMPLETED"
        )
        await supervisor.stop()  # the drain must not restart the workers it stops
        await drain_and_stop(app, server, serving, s.drain_timeout_s, cut)  # then the workers
        return 0
    finally:
        stop_workers(children)
        credentials.close()
        log.info("stopped")


def main(argv: list[str]) -> None:
    settings = parse(ServeSettings, argv)
    if settings.parent_pid is not None:
        die_with(settings.parent_pid)
    configure_logging(settings.log_level)
    sys.exit(run_loop(serve(settings)))
