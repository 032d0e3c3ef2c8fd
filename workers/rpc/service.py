"""One servicer for both roles, and `serve_role`, which starts a worker of either.

Methods are thin: request -> call (convert; a draft's tree policy is checked
against the worker's limit and fitted to the session's cache) -> the batcher,
which hands the calls of all sessions to one runner step on the engine
thread (`propose(calls)` for a drafter, `verify(calls)` for the target) ->
response. Errors are raised as the runners raise them; the interceptor
(workers/rpc/status.py) maps them to status codes. A batch message (VerifyBatch,
and each message of VerifyStream or ProposeStream) submits its calls side by
side and answers each with its response or its error's status; each is also
counted as a Verify or Propose call. A stream answers its messages under their
tags as they finish, those finished together in one reply where they ask
(merge_replies); once the worker shuts down it refuses each new one's calls
with UNAVAILABLE, as the interceptor refuses a new call (workers/rpc/stream.py
is the client side).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING

import grpc

from proto.specsplit.v1 import specsplit_pb2 as pb
from proto.specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from workers.draft.features import model_drafter
from workers.draft.ngram import NgramDrafter
from workers.draft.runner import ModelDrafter
from workers.engine.sessions import SessionTable
from workers.protocol import ProposeCall, Role, TreeSpec, VerifyCall
from workers.rpc import convert
from workers.rpc.batcher import Batcher, EngineThread
from workers.rpc.metrics import MeteredEngine, WorkerMetrics
from workers.rpc.server import WorkerServer
from workers.rpc.status import REFUSED, CallGate, answer
from workers.target.runner import TargetRunner

if TYPE_CHECKING:
    from workers.engine.engine import Engine
    from workers.worker import WorkerSettings

Runner = ModelDrafter | NgramDrafter | TargetRunner


@dataclass(frozen=True)
class Service:
    """What differs between the roles on the wire."""

    name: str  # the full gRPC service name, e.g. specsplit.v1.TargetService
    register: Callable[[object, object], None]  # adds a servicer to a grpc.aio server


SERVICES: dict[Role, Service] = {
    "draft": Service(
        pb.DESCRIPTOR.services_by_name["DraftService"].full_name,
        pb_grpc.add_DraftServiceServicer_to_server,
    ),
    "target": Service(
        pb.DESCRIPTOR.services_by_name["TargetService"].full_name,
        pb_grpc.add_TargetServiceServicer_to_server,
    ),
}


def check_spec(spec: TreeSpec, max_nodes: int) -> None:
    """Rejects policies that would make the worker do unbounded work."""
    for name in ("depth", "branching", "budget"):
        if getattr(spec, name) > max_nodes:
            raise ValueError(
                f"tree {name} {getattr(spec, name)} is over this worker's limit of {max_nodes}"
            )


def fit_spec(spec: TreeSpec, history_len: int, cache_len: int) -> TreeSpec:
    """Shrinks the depth so the tree being expanded fits in the session's cache slot.

    Expanding feeds the history's uncached tail, then at each later level at
    most `branching` nodes, so the slot holds at most
    history_len + (depth - 1) * branching entries.
    """
    room = cache_len - history_len
    depth = min(spec.depth, 1 + room // spec.branching) if room > 0 else 0
    return spec if depth == spec.depth else replace(spec, depth=depth)


def brought(tokens: list[int], prefill_chunk: int | None) -> int:
    """History tokens a call feeds in one step: all, or one chunk when prefilled in chunks."""
    return len(tokens) if prefill_chunk is None else min(len(tokens), prefill_chunk)


def propose_cost(call: ProposeCall, prefill_chunk: int | None = None) -> int:
    """Tokens a call feeds in one step, at most: what it brings plus one level per depth."""
    return brought(call.tokens, prefill_chunk) + call.spec.depth * call.spec.branching + 1


def verify_cost(call: VerifyCall, prefill_chunk: int | None = None) -> int:
    """Tokens a call feeds in one step, at most: what it brings plus its tree and the root."""
    return brought(call.tokens, prefill_chunk) + len(call.tree) + 1


@dataclass(frozen=True)
class Batched:
    """A method whose calls also travel several to a message (VerifyBatch, the streams)."""

    method: str  # the servicer's method for one call, and the name it is counted under
    result: type  # one call's answer: a response or a CallError
    response: type  # the message's answer: the results and the tag


# a stream's writer waits at most this many turns of the event loop for more answers to
# join a reply, and a merged reply stops growing past this size (a client takes 64 MiB)
MERGE_TURNS = 8
MERGE_BYTES = 8 << 20

VERIFY = Batched("Verify", pb.VerifyResult, pb.VerifyBatchResponse)
PROPOSE = Batched("Propose", pb.ProposeResult, pb.ProposeBatchResponse)


class WorkerServicer(pb_grpc.DraftServiceServicer, pb_grpc.TargetServiceServicer):
    """Propose (a draft), Verify (a target), EndSession and Info (both)."""

    def __init__(
        self,
        runner: Runner,
        batcher: Batcher,
        thread: EngineThread,
        max_tree_nodes: int,
        cache_len: int = 0,
        on_call: Callable[[str, str], None] = lambda method, code: None,
        gate: CallGate | None = None,
    ):
        self.runner = runner
        self.batcher = batcher
        self.thread = thread
        self.max_tree_nodes = max_tree_nodes
        self.cache_len = cache_len  # a model draft's entries per session slot; 0 = no cache
        self.on_call = on_call  # (method, status code name) of each call a message carried
        self.gate = gate if gate is not None else CallGate()  # a stream's calls go through it

    async def Propose(self, request: pb.ProposeRequest, context) -> pb.ProposeResponse:
        call = convert.propose_call(request)
        check_spec(call.spec, self.max_tree_nodes)
        if self.cache_len:
            history = call.base_len + len(call.tokens)
            call = replace(call, spec=fit_spec(call.spec, history, self.cache_len))
        tree, timings = await self.batcher.submit(call)
        return convert.propose_response(tree, timings)

    async def Verify(self, request: pb.VerifyRequest, context) -> pb.VerifyResponse:
        outcome, timings = await self.batcher.submit(convert.verify_call(request))
        return convert.verify_response(replace(outcome, timings=timings))

    async def VerifyBatch(self, request: pb.VerifyBatchRequest, context) -> pb.VerifyBatchResponse:
        return await self.answer_batch(VERIFY, request, context)

    async def VerifyStream(self, requests, context) -> None:
        await self.answer_stream(VERIFY, requests, context)

    async def ProposeStream(self, requests, context) -> None:
        await self.answer_stream(PROPOSE, requests, context)

    async def answer_batch(self, kind: Batched, request, context):
        """Each call of a batch message submitted side by side and answered with its
        response or its error's status; each counted as a call of its own."""
        one = getattr(self, kind.method)
        answers = await asyncio.gather(
            *(one(call, context) for call in request.calls), return_exceptions=True
        )
        results = []
        for answered in answers:
            if isinstance(answered, asyncio.CancelledError):
                raise answered
            if isinstance(answered, BaseException):
                code, details = answer(answered, kind.method)
                error = pb.CallError(code=code.value[0], details=details)
                results.append(kind.result(error=error))
            else:
                code = grpc.StatusCode.OK
                results.append(kind.result(response=answered))
            self.on_call(kind.method, code.name)
        return kind.response(results=results)

    async def answer_stream(self, kind: Batched, requests, context) -> None:
        """Each batch message answered on the stream as soon as its calls are, under its
        tag. Writes are one at a time (gRPC takes one write in flight per stream), and the
        answers ready together go as one reply where their messages asked for it
        (merge_replies): one step answers the calls of several messages, and each reply
        costs both ends a write and a read."""
        ready: list[tuple[bool, object]] = []  # answered, not yet written: (mergeable, answer)
        writing = asyncio.Lock()

        async def reply(request) -> None:
            response = await self.stream_message(kind, request, context)
            response.tag = request.tag
            ready.append((request.merge_replies, response))
            async with writing:
                if ready:
                    await settle(ready)
                taken, ready[:] = ready[:], []
                for message in merged_replies(taken):
                    await context.write(message)

        async with asyncio.TaskGroup() as replies:
            async for request in requests:
                replies.create_task(reply(request))

    async def stream_message(self, kind: Batched, request, context):
        """One message of a stream, as a call: refused once the worker shuts down, in
        flight until answered."""
        if self.gate.refusing:
            refused = pb.CallError(code=grpc.StatusCode.UNAVAILABLE.value[0], details=REFUSED)
            for _ in request.calls:
                self.on_call(kind.method, grpc.StatusCode.UNAVAILABLE.name)
            return kind.response(results=[kind.result(error=refused) for _ in request.calls])
        self.gate.enter()
        try:
            return await self.answer_batch(kind, request, context)
        finally:
            self.gate.leave()

    async def EndSession(self, request: pb.EndSessionRequest, context) -> pb.EndSessionResponse:
        found = await self.thread.run(self.runner.end, request.session_id)
        return pb.EndSessionResponse(found=found)

    async def Info(self, request: pb.InfoRequest, context) -> pb.InfoResponse:
        info = replace(self.runner.info(), max_tree_nodes=self.max_tree_nodes)
        return convert.info_to_proto(info)


async def settle(ready: list) -> None:
    """Waits while answers still join `ready` (at most MERGE_TURNS turns of the event
    loop): a step's answers reach their messages' tasks in the same turns."""
    for _ in range(MERGE_TURNS):
        before = len(ready)
        await asyncio.sleep(0)
        if len(ready) == before:
            return


def merged_replies(answers: list[tuple[bool, object]], limit: int = MERGE_BYTES) -> list:
    """The replies that carry `answers` (mergeable, response), in order: each mergeable
    one joins the reply before it (under `merged`) while that stays within `limit` bytes,
    else opens a reply; any other goes alone."""
    replies, head, size = [], None, 0
    for merge, response in answers:
        if not merge:
            replies.append(response)
            continue
        n = response.ByteSize()
        if head is None or size + n > limit:
            head, size = response, n
            replies.append(head)
        else:
            head.merged.append(response)
            size += n
    return replies


def runner_for(
    role: Role, engine: Engine | None, settings: WorkerSettings, metrics: WorkerMetrics
) -> tuple[Runner, int]:
    """The role's runner over `engine` (None: the n-gram drafter) and its cache entries per slot."""
    idle_s = settings.idle_timeout_s
    if engine is None:
        if role == "target":
            raise ValueError("the target needs a model; 'ngram' is a draft only")
        table = SessionTable(settings.max_sessions, idle_s)
        return NgramDrafter(table, min_match=settings.ngram_min_match), 0
    metered = MeteredEngine(engine, metrics.observe_forward)
    table = SessionTable(engine.num_slots, idle_s)
    chunk = settings.prefill_chunk or None
    if role == "target":
        states = settings.prefix_state_mib << 20
        return (
            TargetRunner(
                metered,
                table,
                settings.max_tree_nodes,
                chunk,
                state_bytes=states,
                row_block=settings.row_block or None,
                lookup_rows=None if settings.lookup_rows < 0 else settings.lookup_rows,
                long_match=settings.lookup_long_match,
            ),
            0,
        )
    return model_drafter(metered, table, chunk), engine.context_length + engine.max_tree_nodes


async def serve_role(role: Role, engine: Engine | None, settings: WorkerSettings) -> WorkerServer:
    """Starts a `role` worker over `engine`, or a model-free n-gram draft worker when None."""
    metrics = WorkerMetrics(role, engine.model.prompt_token_share if engine is not None else 1.0)
    runner, cache_len = runner_for(role, engine, settings, metrics)
    thread = EngineThread(f"{role}-engine")
    target = role == "target"
    chunk = (settings.prefill_chunk or None) if engine is not None else None
    batcher = Batcher(
        runner.verify if target else runner.propose,
        thread,
        key=lambda call: call.session_id,
        cost=partial(verify_cost if target else propose_cost, prefill_chunk=chunk),
        wait_s=settings.batch_wait_ms / 1000,
        wait_share=settings.batch_wait_share,
        max_tokens=settings.max_batch_tokens,
        on_batch=metrics.observe_batch,
        held_sessions=runner.due_sessions if target else lambda: runner.table.sessions.keys(),
        fed=(lambda: metrics.fed_work) if engine is not None else None,
    )
    gate = CallGate()
    servicer = WorkerServicer(
        runner, batcher, thread, settings.max_tree_nodes, cache_len, metrics.observe_request, gate
    )
    service = SERVICES[role]
    return await WorkerServer.start(
        role,
        service.name,
        servicer,
        service.register,
        batcher,
        thread,
        runner.table,
        metrics,
        settings.server_options(),
        settings.security(),
        gate,
    )
