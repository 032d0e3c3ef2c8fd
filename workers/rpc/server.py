"""A running worker: the grpc.aio server around one service, plus what every worker needs.

`WorkerServer.start` binds the port (TLS when given a ServerSecurity, with the
token interceptor when it carries a token; workers/rpc/security.py) with
the error interceptor, registers the service and the standard
`grpc.health.v1` health service (also alone on a plaintext health port when
asked, for probes), starts the batcher, the idle-session reaper and the
/metrics HTTP server. `shutdown` is what
SIGTERM does: health goes NOT_SERVING (calls are still served for drain_s),
then new calls are refused with UNAVAILABLE, queued and in-flight calls
finish within the grace period, and everything stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from workers.engine.sessions import SessionTable
from workers.rpc.batcher import Batcher, EngineThread
from workers.rpc.metrics import WorkerMetrics
from workers.rpc.security import ServerSecurity, TokenInterceptor
from workers.rpc.status import CallGate, ErrorInterceptor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerOptions:
    """Where and how a worker listens (taken from the worker's settings)."""

    host: str = "127.0.0.1"  # interface to bind; 0.0.0.0 = all
    port: int = 0  # gRPC port; 0 = any free port
    metrics_port: int | None = 0  # /metrics HTTP port; 0 = any free port; None = none
    idle_timeout_s: float = 600.0  # sessions idle this long are ended
    drain_s: float = 1.0  # on shutdown, how long health says NOT_SERVING before calls are refused
    grace_s: float = 10.0  # then, how long in-flight calls may take to finish
    health_port: int | None = 0  # plaintext port with only the health service; None = none


@dataclass
class WorkerServer:
    role: str  # "draft" or "target"
    service_name: str  # full gRPC name, e.g. specsplit.v1.TargetService
    servicer: object  # the WorkerServicer
    server: grpc.aio.Server
    port: int  # the bound gRPC port
    health: health_aio.HealthServicer
    interceptor: ErrorInterceptor
    batcher: Batcher
    thread: EngineThread
    table: SessionTable
    metrics: WorkerMetrics
    options: ServerOptions
    metrics_port: int | None = None  # the bound /metrics port
    health_server: grpc.aio.Server | None = None  # the plaintext health-only server
    health_port: int | None = None  # its bound port
    _metrics_http: object = None
    _tasks: list[asyncio.Task] = field(default_factory=list)
    _stopping: bool = False
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)

    @classmethod
    async def start(
        cls,
        role: str,
        service_name: str,
        servicer: object,
        register: Callable[[object, grpc.aio.Server], None],
        batcher: Batcher,
        thread: EngineThread,
        table: SessionTable,
        metrics: WorkerMetrics,
        options: ServerOptions,
        security: ServerSecurity | None,
        gate: CallGate,
    ) -> WorkerServer:
        interceptor = ErrorInterceptor(metrics.observe_request, gate)
        token = [TokenInterceptor(security.token)] if security and security.token else []
        server = grpc.aio.server(interceptors=[*token, interceptor])
        register(servicer, server)
        health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        port = bind(server, options.host, options.port, security)
        health_server, health_port = None, None
        if options.health_port is not None:
            health_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(health, health_server)
            health_port = bind(health_server, options.host, options.health_port, None)
            await health_server.start()
        metrics.watch_sessions(table)
        batcher.start()
        await server.start()
        worker = cls(
            role, service_name, servicer, server, port, health, interceptor, batcher, thread,
            table, metrics, options, health_server=health_server, health_port=health_port,
        )  # fmt: skip
        if options.metrics_port is not None:
            worker._metrics_http, _ = metrics.serve(options.host, options.metrics_port)
            worker.metrics_port = worker._metrics_http.server_port
        worker._tasks.append(asyncio.create_task(worker._reap(), name="reaper"))
        for name in ("", service_name):
            await health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return worker

    async def _reap(self) -> None:
        """Ends sessions idle for longer than idle_timeout_s."""
        every = max(0.5, min(self.options.idle_timeout_s / 4, 30.0))
        while True:
            await asyncio.sleep(every)
            try:
                ended = await self.thread.run(self.table.reap_idle)
            except Exception:  # noqa: BLE001 - keep reaping
                log.exception("reaping idle sessions failed")
                continue
            if ended:
                log.info("ended %d idle sessions", len(ended))

    async def shutdown(self, grace_s: float | None = None, drain_s: float | None = None) -> None:
        """What SIGTERM does: health NOT_SERVING, drain, refuse new calls, finish in-flight ones.

        For `drain_s` the worker still serves while saying NOT_SERVING, so health
        checkers and watchers (load balancers, the gateway) move new sessions
        elsewhere; then new calls are refused and in-flight calls (queued ones
        run at once) get `grace_s` to finish.
        """
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        grace = self.options.grace_s if grace_s is None else grace_s
        drain = self.options.drain_s if drain_s is None else drain_s
        await self.health.enter_graceful_shutdown()
        if drain > 0:
            await asyncio.sleep(drain)
        # refused by the interceptor rather than by server.stop(grace): grpcio can crash
        # when a second stop() overlaps a pending one, and watches would hold a stop(grace)
        self.interceptor.gate.refuse_new_calls()
        self.batcher.drain()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.interceptor.gate.wait_idle(), grace)
        await self.server.stop(0)  # cancels what is left: health watches, calls past the grace
        if self.health_server is not None:
            await self.health_server.stop(0)
        for task in self._tasks:
            task.cancel()
        await self.batcher.close()
        await asyncio.to_thread(self.thread.close)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        self._stopped.set()


def bind(server: grpc.aio.Server, host: str, port: int, security: ServerSecurity | None) -> int:
    """Adds the listening port (TLS when `security` is set); returns the bound port."""
    address = f"{host}:{port}"
    if security is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, security.credentials())
    if bound == 0:
        raise OSError(f"could not bind {address}")
    return bound
