"""Exceptions <-> gRPC status codes, for the server and the client, in one place.

Server side, `ErrorInterceptor` wraps every SpecSplit method: the service code
raises the runner's own exceptions and the interceptor turns them into a
status (logging the unexpected ones), counts the call, and tracks in-flight
calls for graceful shutdown. Client side, `raise_for_status` turns the status
back into the same exceptions, so a caller writes `except SessionLost:`
whether the runner is in-process or behind gRPC.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from workers.protocol import SessionLost, WorkerBusy

log = logging.getLogger(__name__)

SERVICE_PREFIX = "/specsplit.v1."  # methods of this package are wrapped; health is not

# first match wins: TreeError is a ValueError, SessionLost a KeyError
STATUS_OF: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (SessionLost, grpc.StatusCode.NOT_FOUND),
    (WorkerBusy, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
]


class InvalidRequest(ValueError):
    """The worker rejected the request as malformed (INVALID_ARGUMENT)."""


class WorkerError(RuntimeError):
    """Any other failed call: the worker is down, overloaded, timed out, or hit a bug."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code


def status_of(error: BaseException) -> grpc.StatusCode:
    for kind, code in STATUS_OF:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


def details_of(error: BaseException, code: grpc.StatusCode) -> str:
    if code == grpc.StatusCode.INTERNAL:
        return f"internal error: {type(error).__name__}: {error}"
    return str(error)


def raise_for_status(error: grpc.aio.AioRpcError) -> None:
    """Re-raises a failed call as the exception the worker raised (see STATUS_OF)."""
    code, details = error.code(), error.details() or ""
    if code == grpc.StatusCode.NOT_FOUND:
        raise SessionLost(details) from error
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        raise WorkerBusy(details) from error
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        raise InvalidRequest(details) from error
    raise WorkerError(code, details) from error


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions to status codes, counts calls by method and code, tracks in-flight
    calls, and refuses new ones once the worker shuts down."""

    def __init__(self, on_done: Callable[[str, str], None] = lambda method, code: None):
        self.on_done = on_done  # called with (method, status code name) after every call
        self.inflight = 0
        self.refusing = False  # set on shutdown: new calls get UNAVAILABLE
        self._idle = asyncio.Event()
        self._idle.set()

    def refuse_new_calls(self) -> None:
        self.refusing = True

    async def wait_idle(self) -> None:
        """Returns once no SpecSplit call is in flight."""
        await self._idle.wait()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(SERVICE_PREFIX):
            return handler
        if handler.unary_unary is None:
            return handler
        method = details.method.rsplit("/", 1)[-1]
        inner = handler.unary_unary

        async def guarded(request, context):
            if self.refusing:
                self.on_done(method, grpc.StatusCode.UNAVAILABLE.name)
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
            self.inflight += 1
            self._idle.clear()
            code = grpc.StatusCode.OK
            try:
                return await inner(request, context)
            except asyncio.CancelledError:
                code = grpc.StatusCode.CANCELLED
                raise
            except grpc.aio.AbortError:  # a method that set its own status
                aborted = context.code()
                code = aborted if isinstance(aborted, grpc.StatusCode) else grpc.StatusCode.UNKNOWN
                raise
            except Exception as error:  # noqa: BLE001 - every error becomes a status
                code = status_of(error)
                if code == grpc.StatusCode.INTERNAL:
                    log.exception("%s failed", method)
                await context.abort(code, details_of(error, code))
            finally:
                self.inflight -= 1
                if not self.inflight:
                    self._idle.set()
                self.on_done(method, code.name)

        return grpc.unary_unary_rpc_method_handler(
            guarded,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
