"""Client side of batched calls: the calls of one event-loop turn travel together.

A target's batch ends, its sessions' answers reach the gateway together, and
each session sends its next Verify (and, with a draft worker, its Propose
first) a moment later. As unary calls, each one costs a call's handling in
grpc.aio on both sides (about 0.3 ms of the worker's one Python thread per
call on a 2-core VM), and the worker's batch waits for the last of them: at
8 streams the engine sat idle about 5 ms between 33 ms forwards. `Coalescer`
queues the requests made in one turn of the event loop and sends them as one
batch (a message of the worker's stream, or a VerifyBatch call; one request
alone may go as a plain call); each caller gets its own response or its own
error.

A batch is answered once every call in it is, so calls that take different
numbers of the worker's steps travel apart (`group`): a Verify decoding several
tokens (`VerifyRequest.steps`) goes in a batch of such calls, which the worker
answers after the same forward (workers/target/runner.py), and a one-step call
does not wait for it.

A caller that is cancelled (a hang bound, a client gone) leaves the batch;
once every caller of a batch has left, its call is cancelled. A worker that
cannot take a batch (an older build without VerifyBatch, mid-rollout; a draft
worker called without its stream) raises Unbatched: from then on the calls
go one by one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from workers.protocol import WorkerError

Request = TypeVar("Request")  # one call's request (pb.VerifyRequest, pb.ProposeRequest)
Response = TypeVar("Response")  # its response


class Unbatched(Exception):
    """The worker does not take these calls in batches."""


@dataclass
class _Batch(Generic[Request]):
    requests: list[Request]
    callers: list[asyncio.Future]
    task: asyncio.Task | None = None
    answered: bool = False  # the call returned: the callers are being answered

    def abandon(self, _: asyncio.Future) -> None:
        """A caller left: once none is waiting, the call is cancelled."""
        if not self.answered and self.task is not None and all(f.done() for f in self.callers):
            self.task.cancel()


def steps_apart(request) -> bool:
    """The group of a call: whether it decodes several steps (a Verify's `steps`)."""
    return getattr(request, "steps", 0) > 1


@dataclass
class Coalescer(Generic[Request, Response]):
    """Requests made in one turn of the event loop, sent as one batch per `group`."""

    one: Callable[[Request], Awaitable[Response]]  # one call
    # a batch: each request's response or its error; raises Unbatched
    many: Callable[[list[Request]], Awaitable[Sequence[Response | WorkerError]]]
    batching: bool = True  # False once the worker said it takes no batches
    # requests of one group share a batch (module docstring)
    group: Callable[[Request], Hashable] = steps_apart
    queue: list[tuple[Request, asyncio.Future]] = field(default_factory=list)
    sending: set[asyncio.Task] = field(default_factory=set)

    async def call(self, request: Request) -> Response:
        if not self.batching:
            return await self.one(request)
        loop = asyncio.get_running_loop()
        if not self.queue:
            loop.call_soon(self.flush)
        caller = loop.create_future()
        self.queue.append((request, caller))
        return await caller

    def flush(self) -> None:
        queued, self.queue = self.queue, []
        groups: dict[Hashable, list[tuple[Request, asyncio.Future]]] = {}
        for request, caller in queued:
            if not caller.done():
                groups.setdefault(self.group(request), []).append((request, caller))
        for members in groups.values():
            self.send_batch(members)

    def send_batch(self, queued: list[tuple[Request, asyncio.Future]]) -> None:
        batch = _Batch([r for r, _ in queued], [c for _, c in queued])
        batch.task = asyncio.get_running_loop().create_task(self.send(batch))
        self.sending.add(batch.task)
        batch.task.add_done_callback(self.sending.discard)
        for caller in batch.callers:
            caller.add_done_callback(batch.abandon)

    async def send(self, batch: _Batch) -> None:
        try:
            answers = await self.answers(batch.requests)
        except Exception as error:  # noqa: BLE001 - the whole call failed: every caller gets it
            answers = [error] * len(batch.callers)
        batch.answered = True
        for caller, answered in zip(batch.callers, answers, strict=True):
            if caller.done():
                continue
            if isinstance(answered, BaseException):
                caller.set_exception(answered)
            else:
                caller.set_result(answered)

    async def answers(self, requests: list[Request]) -> Sequence[Response | BaseException]:
        if len(requests) == 1:
            return [await self.one(requests[0])]
        if self.batching:
            try:
                return await self.many(requests)
            except Unbatched:
                self.batching = False
        return await asyncio.gather(*(self.one(r) for r in requests), return_exceptions=True)
