"""Backends over gRPC: the gateway's view of `specsplit worker draft|target`.

Wraps `workers.rpc.client.DraftClient` / `TargetClient` (one grpc.aio channel
per worker) and maps their failures to the gateway's worker errors:
NOT_FOUND -> SessionLost, RESOURCE_EXHAUSTED -> WorkerBusy, INVALID_ARGUMENT
-> InvalidCall, anything else (UNAVAILABLE when the process is gone,
DEADLINE_EXCEEDED, INTERNAL, a dropped connection) -> WorkerDown.
"""

from __future__ import annotations

import asyncio
from dataclasses import fields

import grpc

from workers.protocol import (
    InvalidCall,
    ProposeCall,
    Role,
    SessionLost,
    VerifyCall,
    VerifyOutcome,
    WorkerBusy,
    WorkerDown,
    WorkerError,
    WorkerInfo,
)
from workers.speculation.tree import TokenTree

STATUS_ERRORS = {
    grpc.StatusCode.NOT_FOUND: SessionLost,
    grpc.StatusCode.RESOURCE_EXHAUSTED: WorkerBusy,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidCall,
}


def worker_error(error: BaseException) -> WorkerError:
    """The gateway's error for a failed call, whatever layer raised it."""
    if isinstance(error, WorkerError):
        return error
    if isinstance(error, SessionLost):
        return SessionLost(str(error))
    if isinstance(error, WorkerBusy):
        return WorkerBusy(str(error))
    if isinstance(error, ValueError):  # the client's InvalidRequest
        return InvalidCall(str(error))
    code = getattr(error, "code", None)
    code = code() if callable(code) else code  # AioRpcError.code() or the client's .code
    kind = STATUS_ERRORS.get(code, WorkerDown)
    return kind(f"{type(error).__name__}: {error}")


# reconnect within a second or two of a worker (re)starting, not after gRPC's default
# backoff of up to two minutes: health checks and failover depend on it
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 64 << 20),
]


class GrpcBackend:
    def __init__(self, role: Role, address: str, timeout_s: float | None = 60.0):
        from workers.rpc.client import DraftClient, TargetClient

        self.role = role
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        client_class = DraftClient if role == "draft" else TargetClient
        self.client = client_class(self.channel, timeout=timeout_s)

    async def call(self, method: str, *args):
        try:
            return await getattr(self.client, method)(*args)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - every failure becomes a worker error
            raise worker_error(error) from error

    async def propose(self, call: ProposeCall) -> TokenTree:
        result = await self.call("propose", call)
        return getattr(result, "tree", result)  # a Proposal (tree + timings) or a tree

    async def verify(self, call: VerifyCall) -> VerifyOutcome:
        result = await self.call("verify", call)
        return getattr(result, "outcome", result)  # a Verified (outcome + timings) or an outcome

    async def end(self, session_id: str) -> None:
        await self.call("end_session", session_id)

    async def health(self) -> bool:
        return bool(await self.client.health())

    async def info(self) -> WorkerInfo:
        theirs = await self.call("info")
        names = {f.name for f in fields(WorkerInfo)}
        values = {name: getattr(theirs, name) for name in names if hasattr(theirs, name)}
        values["eos_token_ids"] = tuple(values.get("eos_token_ids", ()))
        return WorkerInfo(**values)

    async def close(self) -> None:
        await self.channel.close()


class GrpcFactory:
    """A BackendFactory that dials each address over gRPC."""

    def __init__(self, timeout_s: float | None = 60.0):
        self.timeout_s = timeout_s

    def __call__(self, role: Role, address: str) -> GrpcBackend:
        return GrpcBackend(role, address, self.timeout_s)
