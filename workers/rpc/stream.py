"""Client side of VerifyStream and ProposeStream: a worker's batches as messages of one stream.

A unary call costs grpc.aio a call's setup and teardown on both sides, about
0.5 ms of a round trip on localhost where a message on an open stream costs
0.15 (a 2-core VM): with a small or graphed model that is a large share of a
round. `CallStream` opens one bidirectional stream to the worker on first use
and queues each batch (a VerifyBatchRequest or ProposeBatchRequest) for the
stream's writer under a fresh tag; its reader hands each response to the
caller waiting on that tag. Responses may come back in any order (two batches
in flight run in different steps), and the batches answered by one step come
back as one reply (`merged`, which every batch asks for): the calls one step
answers can arrive in several messages, and each reply costs both ends a
system call (with a reply per message, the stream's writes took a third of a
gateway's CPU at 16 chat streams here).

Faults look as they do for unary calls: a caller that waits longer than the
deadline gets WorkerDown (the worker's late answer is dropped); when the
stream ends (the worker killed, restarted, shutting down, the connection
lost) every caller still waiting on it gets the stream's status as a worker
error, and the next batch opens a new stream. A caller that leaves (a hang
bound, cancellation) stops waiting; its message is still written (cancelling
a write would cancel the stream under every other caller), the worker answers
it and the answer is dropped, as a unary call cancelled after the worker took
it. A worker without the method (an older build) ends the stream
UNIMPLEMENTED: `Unstreamed` tells the caller to send its batches as calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from proto.specsplit.v1 import specsplit_pb2 as pb
from workers.protocol import WorkerDown
from workers.rpc.status import error_from

DONE = None  # queued after the last batch: the writer half-closes the stream

Batch = pb.VerifyBatchRequest | pb.ProposeBatchRequest
BatchAnswer = pb.VerifyBatchResponse | pb.ProposeBatchResponse


class Unstreamed(Exception):
    """The worker does not serve the stream."""


@dataclass
class _Open:
    """One open stream: its writer's queue and the callers waiting on it, by tag."""

    call: grpc.aio.StreamStreamCall
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    waiting: dict[int, asyncio.Future] = field(default_factory=dict)
    tasks: list[asyncio.Task] = field(default_factory=list)  # writer, reader
    closed: bool = False  # the reader saw the stream end: no more answers come


@dataclass
class CallStream:
    """Batches of calls to one worker as messages of one stream, opened on first use."""

    open_call: Callable[[], grpc.aio.StreamStreamCall]  # starts the stream (stub method)
    timeout_s: float | None  # how long a caller waits for its answer; None = for ever
    tags: itertools.count = field(default_factory=lambda: itertools.count(1))
    current: _Open | None = None

    async def send(self, batch: Batch) -> BatchAnswer:
        """The worker's answer to `batch` (its tag is set here); raises a WorkerError when
        the stream fails or the deadline passes, Unstreamed when the worker has no stream."""
        stream = self._stream()
        batch.tag = tag = next(self.tags)
        batch.merge_replies = True
        answer = asyncio.get_running_loop().create_future()
        stream.waiting[tag] = answer
        stream.outbox.put_nowait(batch)
        try:
            return await asyncio.wait_for(answer, self.timeout_s)
        except TimeoutError:
            raise WorkerDown(f"DEADLINE_EXCEEDED: no answer within {self.timeout_s} s") from None
        finally:
            stream.waiting.pop(tag, None)

    def _stream(self) -> _Open:
        if self.current is None or self.current.closed:
            stream = _Open(self.open_call())
            loop = asyncio.get_running_loop()
            stream.tasks = [
                loop.create_task(self._write(stream), name="call-stream-writer"),
                loop.create_task(self._read(stream), name="call-stream-reader"),
            ]
            self.current = stream
        return self.current

    @staticmethod
    async def _write(stream: _Open) -> None:
        """Writes the queued batches in order until DONE or the stream fails."""
        with contextlib.suppress(
            grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError
        ):
            while (batch := await stream.outbox.get()) is not DONE:
                await stream.call.write(batch)
            await stream.call.done_writing()

    async def _read(self, stream: _Open) -> None:
        """Hands each response to its caller until the stream ends, then fails the rest."""
        try:
            while (response := await stream.call.read()) is not grpc.aio.EOF:
                for answered in (response, *response.merged):
                    answer = stream.waiting.get(answered.tag)
                    if answer is not None and not answer.done():
                        answer.set_result(answered)
        except grpc.aio.AioRpcError:
            pass
        except asyncio.CancelledError:
            if not stream.call.cancelled():  # this task cancelled, not the call
                raise
        finally:
            stream.closed = True
            stream.tasks[0].cancel()  # the writer: nothing it writes will be answered
            failure = await self._failure(stream.call)
            for answer in stream.waiting.values():
                if not answer.done():
                    answer.set_exception(failure)

    @staticmethod
    async def _failure(call: grpc.aio.StreamStreamCall) -> Exception:
        """What a caller the stream did not answer gets: the stream's status as a worker
        error (WorkerDown where it ended cleanly), or Unstreamed."""
        try:
            code, details = await call.code(), await call.details()
        except asyncio.CancelledError:
            code, details = grpc.StatusCode.CANCELLED, "the stream was cancelled"
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return Unstreamed()
        if code == grpc.StatusCode.OK:
            code, details = grpc.StatusCode.UNAVAILABLE, "the worker closed the stream"
        return error_from(code, details)

    async def close(self, grace_s: float = 0.25) -> None:
        """Ends the stream: cleanly (the worker answers what it holds, then counts the
        stream OK) within `grace_s`, else cancelled."""
        stream, self.current = self.current, None
        if stream is None:
            return
        stream.outbox.put_nowait(DONE)
        done, _ = await asyncio.wait([stream.tasks[1]], timeout=grace_s)
        if not done:
            stream.call.cancel()
        for task in stream.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
