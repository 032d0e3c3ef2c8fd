"""`specsplit gateway`: the OpenAI-compatible gateway over draft and target worker pools.

    specsplit gateway --target-addresses target-0:50061,target-1:50061 \
                      --draft-addresses drafts.specsplit.svc:50051 \
                      --worker-ca tls/ca.crt --worker-token-file tls/token

The workers are reached over TLS (`--worker-ca`, with `--worker-cert` and
`--worker-key` for mutual TLS and `--worker-token-file` for their token);
plaintext only with `--insecure`.

Without --draft-addresses the draft runs inside the gateway (--local-draft
ngram, the default) or not at all (--local-draft none).

SIGTERM (or Ctrl-C) drains: /health and new requests answer 503 (with
Retry-After) while the requests in flight finish, for up to
--drain-timeout-s (30 s); then the server stops and exits 0. A second signal
stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys

import uvicorn

from gateway.app import create_app
from gateway.settings import GatewaySettings
from workers.settings import parse
from workers.worker import freeze_heap, log_runtime, run_loop


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


class Server(uvicorn.Server):
    """uvicorn without its own signal handling: the command owns SIGINT/SIGTERM, so that
    it drains before uvicorn stops (which would end every open SSE stream)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def stop_on_signals(stop: asyncio.Event, cut: asyncio.Event) -> None:
    """The first SIGINT or SIGTERM sets `stop` (drain, then exit); a second one sets `cut`
    (stop waiting for the requests in flight)."""

    def on_signal() -> None:
        (cut if stop.is_set() else stop).set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)


async def drain_and_stop(
    app, server: Server, serving: asyncio.Task, timeout_s: float, cut: asyncio.Event
) -> None:
    """Drains the gateway (Gateway.drain), then stops uvicorn."""
    gateway = getattr(app.state, "gateway", None)
    if gateway is not None and not serving.done():
        await gateway.drain(timeout_s, cut)
    server.handle_exit(signal.SIGTERM, None)  # through sse-starlette's hook: it ends open streams
    await serving


async def run(settings: GatewaySettings) -> int:
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=5,
    )
    server = Server(config)
    stop, cut = asyncio.Event(), asyncio.Event()
    stop_on_signals(stop, cut)
    serving = asyncio.create_task(server.serve())
    while not (server.started or serving.done() or stop.is_set()):
        await asyncio.sleep(0.05)
    if server.started:
        freeze_heap("gateway")
        log_runtime("gateway", config.http_protocol_class.__name__)
    await asyncio.wait([serving, asyncio.create_task(stop.wait())], return_when="FIRST_COMPLETED")
    await drain_and_stop(app, server, serving, settings.drain_timeout_s, cut)
    return 0 if server.started else 1


def main(argv: list[str]) -> None:
    settings = parse(GatewaySettings, argv)
    configure_logging(settings.log_level)
    try:
        settings.worker_security()  # the same check the app makes, before it starts
    except (ValueError, OSError) as error:
        sys.exit(f"specsplit gateway: {error}")
    sys.exit(run_loop(run(settings)))
