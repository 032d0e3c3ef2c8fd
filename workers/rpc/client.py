"""A worker over gRPC, as the Backend the loop and the gateway call.

    target = GrpcBackend("target", "10.0.0.7:50051")
    draft = GrpcBackend("draft", "10.0.0.8:50052")
    check_pair(await draft.info(), await target.info())
    tree = await draft.propose(ProposeCall(sid, 0, prompt, spec))
    outcome = await target.verify(VerifyCall(sid, 0, prompt, tree, params))

One grpc.aio channel per worker (TLS with a token when given a ClientSecurity,
workers/rpc/security.py), reconnecting within a second or two of a
worker (re)starting. Every failed call raises a workers.protocol error
(workers/rpc/status.py): SessionLost, WorkerBusy, InvalidCall, or WorkerDown
for anything else (unreachable, deadline, internal, a dropped connection).
The Verify (Propose) calls of one event-loop turn go out together
(workers/rpc/coalesce.py), as a message of the one VerifyStream (ProposeStream)
to the worker (workers/rpc/stream.py); where the worker has no stream (or
`streaming` is off) as a VerifyBatch call (Propose calls one by one).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from functools import partial

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.specsplit.v1 import specsplit_pb2 as pb
from proto.specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from workers.protocol import (
    InvalidCall,
    ProposeCall,
    Role,
    VerifyCall,
    VerifyOutcome,
    WorkerDown,
    WorkerError,
    WorkerInfo,
    as_worker_error,
)
from workers.rpc import convert
from workers.rpc.coalesce import Coalescer, Unbatched
from workers.rpc.security import ClientSecurity
from workers.rpc.status import code_numbered, error_from, error_of
from workers.rpc.stream import CallStream, Unstreamed
from workers.speculation.tree import TokenTree

# reconnect within a second or two of a worker (re)starting, not after gRPC's default
# backoff of up to two minutes: health checks and failover depend on it
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 64 << 20),
]

STUBS = {"draft": pb_grpc.DraftServiceStub, "target": pb_grpc.TargetServiceStub}


@dataclass(frozen=True)
class RoundCalls:
    """How a role's per-round calls travel."""

    method: str  # the unary method of one call
    batch: type  # the message carrying several
    stream: str  # the stream of such messages
    unary_batch: str | None  # a unary method taking one such message; None = none


ROUNDS = {
    "target": RoundCalls("Verify", pb.VerifyBatchRequest, "VerifyStream", "VerifyBatch"),
    "draft": RoundCalls("Propose", pb.ProposeBatchRequest, "ProposeStream", None),
}


@dataclass
class Wire:
    """Bytes a client put on and took off the wire (serialized messages, no framing)."""

    calls: int = 0  # the sessions' calls (a VerifyBatch counts those it carries)
    messages: int = 0  # unary calls and stream messages: what crossed the wire
    request_bytes: int = 0
    response_bytes: int = 0


class GrpcBackend:
    """One draft or target worker at `address` ("host:port")."""

    def __init__(
        self,
        role: Role,
        address: str,
        timeout_s: float | None = 60.0,
        security: ClientSecurity | None = None,
        streaming: bool = True,
    ):
        self.role = role
        self.address = address
        self.timeout_s = timeout_s  # per-call deadline; None = none
        if security is None:
            self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self.metadata: tuple[tuple[str, str], ...] = ()
        else:
            options = CHANNEL_OPTIONS + security.channel_options()
            self.channel = grpc.aio.secure_channel(address, security.credentials(), options)
            self.metadata = security.metadata()
        self.stub = STUBS[role](self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.wire = Wire()
        self.rounds = ROUNDS[role]
        # a round's calls on one stream (False once the worker said it has none)
        self.streaming = streaming
        stream_method = getattr(self.stub, self.rounds.stream)
        self.stream = CallStream(partial(stream_method, metadata=self.metadata), timeout_s)
        self.calls = Coalescer(self.one, self.many)

    async def call(self, method: str, request, calls: int = 1):
        """One call of `method`; `calls`: the sessions' calls it carries (a VerifyBatch)."""
        try:
            response = await getattr(self.stub, method)(
                request, timeout=self.timeout_s, metadata=self.metadata
            )
        except grpc.aio.AioRpcError as error:
            raise error_of(error) from error
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - a closed channel, a bad message, ...
            raise WorkerDown(f"{type(error).__name__}: {error}") from error
        self.count(request, response, calls)
        return response

    def count(self, request, response, calls: int) -> None:
        self.wire.calls += calls
        self.wire.messages += 1
        self.wire.request_bytes += request.ByteSize()
        self.wire.response_bytes += response.ByteSize()

    async def propose(self, call: ProposeCall) -> TokenTree:
        if self.role != "draft":
            raise InvalidCall("a target worker does not propose")
        response = await self.calls.call(convert.propose_request(call))
        try:
            return convert.tree_from_proto(response.tree)
        except ValueError as error:
            raise as_worker_error(error) from error

    async def verify(self, call: VerifyCall) -> VerifyOutcome:
        if self.role != "target":
            raise InvalidCall("a draft worker does not verify")
        return convert.verify_outcome(await self.calls.call(convert.verify_request(call)))

    async def one(self, request):
        """One session's round call alone: a message of the stream, or a unary call."""
        if self.streaming:
            answered = (await self.many([request]))[0]
            if isinstance(answered, WorkerError):
                raise answered
            return answered
        return await self.call(self.rounds.method, request)

    async def many(self, requests: list) -> list:
        """Several sessions' round calls in one (workers/rpc/coalesce.py): each one's
        response or its error."""
        batch = self.rounds.batch(calls=requests)
        if self.streaming:
            try:
                response = await self.stream.send(batch)
            except Unstreamed:
                self.streaming = False
            else:
                self.count(batch, response, len(requests))
                return answers(response)
        if len(requests) == 1:
            return [await self.call(self.rounds.method, requests[0])]
        if self.rounds.unary_batch is None:
            raise Unbatched
        try:
            response = await self.call(self.rounds.unary_batch, batch, len(requests))
        except WorkerDown as error:
            if isinstance(error.__cause__, grpc.aio.AioRpcError) and (
                error.__cause__.code() == grpc.StatusCode.UNIMPLEMENTED
            ):
                raise Unbatched from error
            raise
        return answers(response)

    async def end(self, session_id: str) -> bool:
        response = await self.call("EndSession", pb.EndSessionRequest(session_id=session_id))
        return response.found

    async def health(self, timeout_s: float = 2.0) -> bool:
        """True when the worker's health service says SERVING; False otherwise or unreachable."""
        try:
            response = await self.health_stub.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
        except grpc.aio.AioRpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING

    async def info(self) -> WorkerInfo:
        return convert.info_from_proto(await self.call("Info", pb.InfoRequest()))

    async def close(self) -> None:
        await self.stream.close()
        await self.channel.close()

    async def __aenter__(self) -> GrpcBackend:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def answers(response) -> list:
    """Each call's response, or the error its status stands for."""
    return [
        result.response
        if result.HasField("response")
        else error_from(code_numbered(result.error.code), result.error.details)
        for result in response.results
    ]


class GrpcFactory:
    """A BackendFactory that dials each address over gRPC (TLS when `security` is set)."""

    def __init__(
        self,
        timeout_s: float | None = 60.0,
        security: ClientSecurity | None = None,
        streaming: bool = True,
    ):
        self.timeout_s = timeout_s
        self.security = security
        self.streaming = streaming  # a target's Verify calls as messages of one stream

    def __call__(self, role: Role, address: str) -> GrpcBackend:
        return GrpcBackend(role, address, self.timeout_s, self.security, self.streaming)
