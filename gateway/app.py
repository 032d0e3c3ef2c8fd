"""The FastAPI app, from a factory with a lifespan.

`create_app(settings, backend_factory)` returns an app whose lifespan starts
the Gateway (tokenizer, worker pools, health watching) and stops it. Shared
objects live on `app.state`: settings, metrics, gateway. Without a
backend_factory, workers are reached over gRPC.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError, install_error_handlers
from gateway.metrics import Metrics, endpoint_of
from gateway.routes import STATIC, authenticate_v1, openapi, ops, v1
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from workers.protocol import BackendFactory

log = logging.getLogger("specsplit.gateway")


def create_app(settings: GatewaySettings, backend_factory: BackendFactory | None = None) -> FastAPI:
    metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        factory = backend_factory
        if factory is None:
            from workers.rpc.client import GrpcFactory

            factory = GrpcFactory(
                settings.rpc_timeout_s, settings.worker_security(), settings.worker_streams
            )
        app.state.gateway = await Gateway.start(settings, factory, metrics)
        try:
            yield
        finally:
            await app.state.gateway.close()

    app = FastAPI(title="SpecSplit", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = metrics
    app.openapi = functools.partial(openapi, app)
    install_error_handlers(app, authenticate_v1)
    app.include_router(v1)
    app.include_router(ops)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(CountRequests, metrics=metrics)
    return app


class CountRequests:
    """specsplit_requests_total{endpoint, status}: the status the response started with.

    Also stamps the request's arrival time (request.state.arrived)."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = endpoint_of(scope["path"])
        status = 500
        scope.setdefault("state", {})["arrived"] = time.perf_counter()  # for time to first token

        async def counted_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted_send)
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()


class BodyLimit:
    """Refuses bodies over max_bytes with 413, by Content-Length or as they stream in."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = APIError(
            413, f"the request body is over {self.max_bytes} bytes", None, "request_too_large"
        )
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await reply(send, too_large)
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # a body without Content-Length
                    raise too_large
            return message

        await self.app(scope, limited_receive, send)


async def reply(send: Send, error: APIError) -> None:
    body = json.dumps(error.body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
