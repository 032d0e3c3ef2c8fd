"""`specsplit worker draft|target`: one gRPC worker over one model.

    specsplit worker target --model smollm2-135m-instruct --port 50051 \
        --tls-cert tls/server.crt --tls-key tls/server.key --token-file tls/token
    specsplit worker draft --model ngram --port 50052 --insecure

The channel is TLS: `--tls-cert` and `--tls-key` (made by `specsplit certs`),
`--tls-client-ca` for mutual TLS and `--token-file` for a shared token;
plaintext only with `--insecure`.

Every flag is also an environment variable: `--max-sessions 8` or
`SPECSPLIT_MAX_SESSIONS=8`. SIGTERM (or Ctrl-C) drains the worker: health
goes NOT_SERVING, new calls are refused, in-flight calls get `--grace-s`
seconds to finish, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pydantic import Field
from pydantic_settings import CliPositionalArg

from workers.draft.ngram import MIN_MATCH
from workers.rpc.security import ServerSecurity, read, read_token
from workers.rpc.server import ServerOptions, WorkerServer
from workers.settings import EMBEDDED_MODEL, EngineOptions, parse, settings_config
from workers.speculation.ngram import MAX_NGRAM
from workers.target.runner import LONG_MATCH
from workers.target.states import STATE_BYTES

if TYPE_CHECKING:
    from workers.engine.engine import EngineConfig

log = logging.getLogger("specsplit.worker")

PR_SET_PDEATHSIG = 1
T = TypeVar("T")
DEFAULT_PORTS = {"target": 50051, "draft": 50052}
DEFAULT_MODELS = {"target": EMBEDDED_MODEL, "draft": "ngram"}


class WorkerSettings(EngineOptions):
    model_config = settings_config("worker")

    role: CliPositionalArg[Literal["draft", "target"]] = Field(description="draft or target")
    host: str = Field("0.0.0.0", description="interface to listen on")
    port: int | None = Field(
        None, ge=0, description="gRPC port; default 50051 (target), 50052 (draft); 0 = any free"
    )
    model: str | None = Field(
        None,
        description="alias, directory, .gguf or HF id; the draft also takes an EAGLE head "
        "directory (a feature draft) and 'ngram' (no model); default smollm2-135m-instruct "
        "(target), ngram (draft)",
    )
    max_sessions: int = Field(64, ge=1, description="sessions held at once")
    ngram_min_match: int = Field(
        MIN_MATCH,
        ge=1,
        le=MAX_NGRAM,
        description="with --model ngram: the shortest suffix (tokens) the draft copies after "
        "(the gateway's --ngram-min-match, for its in-gateway draft)",
    )
    kv_tokens: int = Field(
        69632,
        ge=1,
        description="KV cache positions shared by all sessions, in blocks of 16 (default: 64 "
        "sessions of 1,024 tokens and a 64-node tree); memory is taken as sessions write",
    )
    prefill_chunk: int = Field(
        128,
        ge=0,
        description="a target or model draft prefills a long prompt this many tokens per "
        "batch, between the other sessions' rounds; 0 = the whole prompt in one batch",
    )
    prefix_caching: bool = Field(
        True,
        description="share the KV blocks of a prompt prefix between sessions (automatic prefix "
        "caching): a prompt whose first blocks another session has cached skips their prefill",
    )
    prefix_state_mib: int = Field(
        STATE_BYTES >> 20,
        ge=0,
        description="with --prefix-caching, a target keeps the hidden states of cached prompt "
        "blocks for feature-draft sessions in this many MiB (such a session reuses cached KV "
        "only as far as their states reach); 0 = none",
    )
    idle_timeout_s: float = Field(600.0, gt=0, description="end sessions idle this long")
    metrics_port: int | None = Field(
        None, ge=0, description="Prometheus /metrics port; default gRPC port + 1000"
    )
    batch_wait_ms: float = Field(
        10.0,
        ge=0,
        description="a call waits at least this long for others to join its batch (it stops "
        "waiting once every session of the previous batch has a call queued)",
    )
    batch_wait_share: float = Field(
        0.25,
        ge=0,
        le=1,
        description="a call waits up to this share of the previous batch's duration when that "
        "is longer than --batch-wait-ms (the gateway's round trip grows with its streams, and "
        "a session that misses a batch waits a whole one)",
    )
    max_batch_tokens: int = Field(
        2048, ge=1, description="a batch stops growing at this many tokens"
    )
    max_tree_nodes: int = Field(64, ge=1, description="most nodes in one draft tree")
    row_block: int = Field(
        0,
        ge=0,
        description="a target's forward computes rows in blocks of this many: greedy trees "
        "whose last nodes alone would open a block and fill less than half of it are cut; "
        "0 = the engine's (16 on the AMX tile unit, else 1); 1 = never cut",
    )
    lookup_rows: int = Field(
        -1,
        ge=-1,
        description="a target's forward may carry decode steps' own prompt-lookup drafts "
        "(the gateway's --decode-lookup) while it feeds at most this many tokens: the rows it "
        "computes about as cheaply as one; -1 = the engine's (16 on the AMX tile unit, 6 on "
        "the bfloat16 kernel's vector paths, else 1); 0 = none",
    )
    lookup_long_match: int = Field(
        LONG_MATCH,
        ge=0,
        description="past those rows, a decode step still looks up where the session's history "
        "agrees with its latest match over this many tokens (its tokens are then accepted "
        "almost always), while the forward feeds at most 32 tokens; 0 = never; none where "
        "rows come in blocks (the AMX tile unit)",
    )
    drain_s: float = Field(
        1.0,
        ge=0,
        description="on SIGTERM, seconds health says NOT_SERVING before calls are refused",
    )
    grace_s: float = Field(10.0, ge=0, description="then, seconds in-flight calls get to finish")
    tls_cert: Path | None = Field(None, description="PEM certificate chain this worker presents")
    tls_key: Path | None = Field(None, description="its PEM private key")
    tls_client_ca: Path | None = Field(
        None, description="PEM CA: clients must present a certificate it signed (mutual TLS)"
    )
    token_file: Path | None = Field(
        None, description="file holding the token every call must carry (health checks need none)"
    )
    health_port: int | None = Field(
        None,
        ge=0,
        description="plaintext port serving only gRPC health, for probes that cannot speak TLS "
        "(kubelet's); default gRPC port + 2000",
    )
    insecure: bool = Field(
        False, description="plaintext gRPC, no token; else --tls-cert and --tls-key are needed"
    )
    parent_pid: int | None = Field(
        None, description="stop (SIGTERM) when this process ends; Linux (serve sets it)"
    )

    @property
    def grpc_port(self) -> int:
        return DEFAULT_PORTS[self.role] if self.port is None else self.port

    @property
    def model_name(self) -> str:
        return DEFAULT_MODELS[self.role] if self.model is None else self.model

    def server_options(self) -> ServerOptions:
        port = self.grpc_port

        def beside(offset: int, chosen: int | None) -> int:
            return (port + offset if port else 0) if chosen is None else chosen

        return ServerOptions(
            self.host, port, beside(1000, self.metrics_port), self.idle_timeout_s, self.drain_s,
            self.grace_s, beside(2000, self.health_port),
        )  # fmt: skip

    def security(self) -> ServerSecurity | None:
        """TLS and token from the files named, or None (plaintext) only with --insecure."""
        if self.insecure:
            return None
        if self.tls_cert is None or self.tls_key is None:
            raise ValueError(
                "a worker serves TLS: give --tls-cert and --tls-key (`specsplit certs` makes "
                "them), or --insecure for plaintext"
            )
        return ServerSecurity(
            read(self.tls_cert), read(self.tls_key), read(self.tls_client_ca),
            read_token(self.token_file),
        )  # fmt: skip

    def engine_config(self) -> EngineConfig:
        from workers.engine.engine import EngineConfig

        return EngineConfig(
            model=self.model_name,
            device=self.device,
            dtype=self.dtype,
            attention=self.attention,
            kernel_threads=self.kernel_threads,
            amx=self.amx,
            compiled_blocks=self.compiled_blocks,
            cuda_graphs=self.cuda_graphs,
            max_sessions=self.max_sessions,
            max_seq_len=self.max_seq_len,
            kv_tokens=self.kv_tokens,
            max_tree_nodes=self.max_tree_nodes,
            prefix_caching=self.prefix_caching,
            cache_dir=self.model_cache,
        )


async def start(settings: WorkerSettings) -> WorkerServer:
    """Loads the model (none for an n-gram draft) and starts the worker's server."""
    from workers.engine.engine import Engine
    from workers.rpc.service import serve_role

    engine = None
    if settings.model_name != "ngram":
        engine = await asyncio.to_thread(Engine.load, settings.engine_config())
        engine.torch_beside_kernel()
    return await serve_role(settings.role, engine, settings)


async def run(settings: WorkerSettings) -> None:
    server = await start(settings)
    freeze_heap(f"{settings.role} worker")
    log_runtime(f"{settings.role} worker")
    log.info(
        "%s worker serving %s on %s:%d (metrics on port %s)",
        settings.role,
        settings.model_name,
        settings.host,
        server.port,
        server.metrics_port,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info(
        "draining: health NOT_SERVING for %.1f s, then %.1f s for in-flight calls",
        settings.drain_s,
        settings.grace_s,
    )
    await server.shutdown()
    log.info("stopped")


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Runs `main` to its end on uvloop's event loop (libuv), where uvloop is installed (a
    dependency wherever it builds), else on asyncio's own. A process's loop carries every
    HTTP request, SSE event and gRPC message it handles; on uvloop, with uvicorn's httptools
    parser, the gateway spent about a tenth less CPU a token at one stream on a 2-core VM,
    and no more anywhere (bench/RESULTS.md, "The gateway's own work")."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def log_runtime(who: str, http: str | None = None) -> None:
    """Logs the running event loop's implementation (and the HTTP protocol, for the gateway)."""
    loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
    log.info("%s: event loop %s%s", who, loop, f", HTTP {http}" if http else "")


def freeze_heap(who: str) -> None:
    """Collects, then moves every object alive now (the model, the tokenizer, the app) out
    of the cyclic collector's view (`gc.freeze`), as a server does once it has started: a
    full collection then scans only what came after. Without it the gateway's full
    collections took 165-190 ms each, every 20-30 s at 32 streams, while every stream and
    the target's next step waited. Logs the objects frozen."""
    gc.collect()
    gc.freeze()
    log.info(
        "%s: %d start-up objects frozen out of the garbage collector", who, gc.get_freeze_count()
    )


def die_with(parent_pid: int) -> None:
    """SIGTERM this process when its parent, `parent_pid`, ends (PR_SET_PDEATHSIG), or now if it
    has already. Set here rather than by the parent between fork and exec, where no Python may
    run safely in a parent that has gRPC threads (serve restarting a worker)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str]) -> None:
    settings = parse(WorkerSettings, argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if settings.parent_pid is not None:
        die_with(settings.parent_pid)
    try:
        run_loop(run(settings))
    except (ValueError, RuntimeError, OSError) as error:  # bad model, port in use, ...
        sys.exit(f"specsplit worker: {error}")
