"""Worker errors <-> gRPC status codes, both ways, in one table.

Server side, `ErrorInterceptor` wraps every SpecSplit method: the runners
raise workers.protocol errors (or a ValueError for a malformed call) and the
interceptor turns them into a status (logging the unexpected ones), counts
the call, and tracks in-flight calls for graceful shutdown. Client side,
`error_of` turns the status back into the same error, so the loop writes
`except SessionLost:` whether the worker is in-process or behind gRPC.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from workers.protocol import InvalidCall, SessionLost, WorkerBusy, WorkerDown, WorkerError

log = logging.getLogger(__name__)

SERVICE_PREFIX = "/specsplit.v1."  # methods of this package are wrapped; health is not

# the one mapping; anything else is INTERNAL on the server and WorkerDown on the client
CODES: dict[type[WorkerError], grpc.StatusCode] = {
    SessionLost: grpc.StatusCode.NOT_FOUND,
    WorkerBusy: grpc.StatusCode.RESOURCE_EXHAUSTED,
    InvalidCall: grpc.StatusCode.INVALID_ARGUMENT,
}


def status_of(error: BaseException) -> grpc.StatusCode:
    """The status a runner's exception is answered with (a ValueError is an InvalidCall)."""
    if isinstance(error, ValueError):  # InvalidCall, TreeError, a parameter out of range
        return CODES[InvalidCall]
    for kind, code in CODES.items():
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


def details_of(error: BaseException, code: grpc.StatusCode) -> str:
    if code == grpc.StatusCode.INTERNAL:
        return f"internal error: {type(error).__name__}: {error}"
    return str(error)


def answer(error: BaseException, method: str) -> tuple[grpc.StatusCode, str]:
    """The status and details a runner's exception is answered with; an unexpected one (a
    bug) is logged."""
    code = status_of(error)
    if code == grpc.StatusCode.INTERNAL:
        log.error("%s failed", method, exc_info=error)
    return code, details_of(error, code)


NUMBERED = {code.value[0]: code for code in grpc.StatusCode}  # google.rpc.Code numbers


def code_numbered(number: int) -> grpc.StatusCode:
    return NUMBERED.get(number, grpc.StatusCode.UNKNOWN)


def error_of(error: grpc.aio.AioRpcError) -> WorkerError:
    """The worker error a failed call's status stands for."""
    return error_from(error.code(), error.details() or "")


def error_from(code: grpc.StatusCode, details: str) -> WorkerError:
    """The worker error a status stands for: UNAVAILABLE (the process is gone),
    DEADLINE_EXCEEDED, INTERNAL, a dropped connection and the rest are WorkerDown."""
    kind = next((kind for kind, known in CODES.items() if known == code), None)
    if kind is None:
        return WorkerDown(f"{code.name}: {details}")
    return kind(details)


class CallGate:
    """The calls a worker is serving, and whether it still takes new ones: the interceptor
    passes each unary call through it, VerifyStream each message (a stream stays open, its
    messages are the calls)."""

    def __init__(self) -> None:
        self.inflight = 0
        self.refusing = False  # set on shutdown: new calls get UNAVAILABLE
        self._idle = asyncio.Event()
        self._idle.set()

    def refuse_new_calls(self) -> None:
        self.refusing = True

    async def wait_idle(self) -> None:
        """Returns once no SpecSplit call is in flight."""
        await self._idle.wait()

    def enter(self) -> None:
        self.inflight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.inflight -= 1
        if not self.inflight:
            self._idle.set()


REFUSED = "the worker is shutting down"


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions to status codes, counts calls by method and code, tracks in-flight
    calls, and refuses new ones once the worker shuts down (through `gate`). A stream is
    counted when it ends; its messages go through the gate themselves."""

    def __init__(
        self,
        on_done: Callable[[str, str], None] = lambda method, code: None,
        gate: CallGate | None = None,
    ):
        self.on_done = on_done  # called with (method, status code name) after every call
        self.gate = gate if gate is not None else CallGate()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(SERVICE_PREFIX):
            return handler
        method = details.method.rsplit("/", 1)[-1]
        serializers = dict(
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
        if handler.stream_stream is not None:  # its messages go through the gate themselves
            guarded = self.guard(method, handler.stream_stream, in_flight=False)
            return grpc.stream_stream_rpc_method_handler(guarded, **serializers)
        if handler.unary_unary is None:
            return handler
        guarded = self.guard(method, handler.unary_unary, in_flight=True)
        return grpc.unary_unary_rpc_method_handler(guarded, **serializers)

    def guard(self, method: str, inner, in_flight: bool):
        """`inner` (a unary method, or a stream's), refused once the worker shuts down, its
        error mapped to a status and counted when it ends; `in_flight`: counted as in flight
        while it runs."""

        async def guarded(request, context):
            if self.gate.refusing:
                self.on_done(method, grpc.StatusCode.UNAVAILABLE.name)
                await context.abort(grpc.StatusCode.UNAVAILABLE, REFUSED)
            if in_flight:
                self.gate.enter()
            code = grpc.StatusCode.OK
            try:
                return await inner(request, context)
            except asyncio.CancelledError:
                code = grpc.StatusCode.CANCELLED
                raise
            except grpc.aio.AbortError:  # a method that set its own status
                code = aborted_code(context)
                raise
            except Exception as error:  # noqa: BLE001 - every error becomes a status
                code, details = answer(error, method)
                await context.abort(code, details)
            finally:
                if in_flight:
                    self.gate.leave()
                self.on_done(method, code.name)

        return guarded


def aborted_code(context) -> grpc.StatusCode:
    """The status a method that aborted set."""
    aborted = context.code()
    return aborted if isinstance(aborted, grpc.StatusCode) else grpc.StatusCode.UNKNOWN
