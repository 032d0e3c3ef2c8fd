"""Clients of the draft and target workers, speaking the runners' dataclasses.

    async with TargetClient("10.0.0.7:50051") as target, DraftClient(...) as draft:
        check_pair(await draft.info(), await target.info())
        tree = (await draft.propose(ProposeCall(sid, 0, prompt, spec))).tree
        outcome = (await target.verify(VerifyCall(sid, 0, prompt, tree, params))).outcome

Failed calls raise what the worker's runner raised (see workers/rpc/errors.py):
SessionLost (re-send the history with base_len 0), WorkerBusy,
InvalidRequest (a ValueError), or WorkerError for anything else (down,
deadline, internal).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.specsplit.v1 import specsplit_pb2 as pb
from proto.specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from workers.protocol import ProposeCall, Timings, VerifyCall, VerifyOutcome, WorkerInfo
from workers.rpc import convert
from workers.rpc.errors import raise_for_status
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree


class IncompatibleWorkers(ValueError):
    """A draft and a target that must not be paired."""


def check_pair(draft: WorkerInfo, target: WorkerInfo) -> None:
    """Raises IncompatibleWorkers unless the draft's token ids mean the same to the target."""
    if draft.role != "draft" or target.role != "target":
        raise IncompatibleWorkers(
            f"expected a draft and a target worker, got {draft.role!r} and {target.role!r}"
        )
    if draft.tokenizer_fingerprint and (
        draft.tokenizer_fingerprint != target.tokenizer_fingerprint
    ):
        raise IncompatibleWorkers(
            f"draft {draft.model_id!r} and target {target.model_id!r} use different tokenizers "
            f"(fingerprints {draft.tokenizer_fingerprint} and {target.tokenizer_fingerprint}): "
            "draft token ids would mean other text to the target"
        )


@dataclass
class Wire:
    """Bytes a client put on and took off the wire (serialized messages, no framing)."""

    calls: int = 0
    request_bytes: int = 0
    response_bytes: int = 0


@dataclass(frozen=True)
class Proposal:
    tree: TokenTree
    timings: Timings


@dataclass(frozen=True)
class Verified:
    outcome: VerifyOutcome
    timings: Timings


class WorkerClient:
    """What both workers answer: Info, EndSession, health."""

    stub_class: type = object

    def __init__(self, target: str | grpc.aio.Channel, timeout: float | None = None):
        """`target` is "host:port" (the client owns the channel) or an open channel."""
        self._owns_channel = isinstance(target, str)
        self.channel = grpc.aio.insecure_channel(target) if isinstance(target, str) else target
        self.stub = self.stub_class(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.timeout = timeout  # per-call deadline in seconds; None = none
        self.wire = Wire()

    async def call(self, method: str, request):
        try:
            response = await getattr(self.stub, method)(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as error:
            raise_for_status(error)
        self.wire.calls += 1
        self.wire.request_bytes += request.ByteSize()
        self.wire.response_bytes += response.ByteSize()
        return response

    async def info(self) -> WorkerInfo:
        return convert.info_from_proto(await self.call("Info", pb.InfoRequest()))

    async def end_session(self, session_id: str) -> bool:
        """Frees the session on the worker; returns whether the worker held it."""
        response = await self.call("EndSession", pb.EndSessionRequest(session_id=session_id))
        return response.found

    async def health(self, timeout: float = 2.0) -> bool:
        """True when the worker's health service says SERVING; False otherwise or unreachable."""
        try:
            response = await self.health_stub.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
        except grpc.aio.AioRpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        if self._owns_channel:
            await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class DraftClient(WorkerClient):
    stub_class = pb_grpc.DraftServiceStub

    async def propose(self, call: ProposeCall) -> Proposal:
        response = await self.call("Propose", convert.propose_request(call))
        return Proposal(
            convert.tree_from_proto(response.tree), convert.timings_from_proto(response.timings)
        )


class TargetClient(WorkerClient):
    stub_class = pb_grpc.TargetServiceStub

    async def verify(self, call: VerifyCall) -> Verified:
        response = await self.call("Verify", convert.verify_request(call))
        return Verified(
            convert.verify_outcome(response), convert.timings_from_proto(response.timings)
        )

    async def prefill(
        self, session_id: str, prompt: list[int], params: SamplingParams, num_logprobs: int = -1
    ) -> Verified:
        """Starts the session from its prompt; the outcome's `emitted` is the first token."""
        request = convert.prefill_request(session_id, prompt, params, num_logprobs)
        response = await self.call("Prefill", request)
        return Verified(
            convert.verify_outcome(response), convert.timings_from_proto(response.timings)
        )
