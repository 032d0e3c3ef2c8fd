"""Cross-session batching: concurrent calls merged into one runner step on one thread.

The engine and the session table are not thread-safe, so everything that
touches them runs on one `EngineThread`. A `Batcher` queues the calls that
arrive from many gRPC handlers and hands them to the runner's batched step
(`TargetRunner.verify(calls)`, `ModelDrafter.propose(calls)`) as one list:

    arrive -> queue -> [wait until the window has passed since the first call
    arrived and since the previous step ended, or the queue holds max_tokens,
    or every session of the previous step has its next call queued] -> take
    calls up to max_tokens -> step(calls) on the engine thread -> each caller
    gets its own result or exception

The window is `wait_s` or `wait_share` of the previous step's duration,
whichever is longer. It also counts from the previous step's end because the
sessions of that step call again a round trip later (the gateway streams,
drafts and sends the next round): without it, a call that queued during a
step would run alone right after it, the step's sessions would queue during
that lone step, and the two groups would alternate, half-size batches for
ever. The round trip grows with the streams the gateway serves (20-60 ms at
16 streams on a 2-core machine), so a fixed few milliseconds split the
batch, while waiting a share of a step costs less than the step a late
session would otherwise wait for. A session appears at most once per batch;
a second call of the same session goes in the next one, as does a call that
did not fit, without waiting again. A call the step answers `UNFINISHED` (a
long prompt prefilled in chunks) goes back to the head of the queue and
joins the next batch with the calls of the other sessions: it waits for the
previous step's sessions for up to the duration of the step it just had (it
is in no hurry; without the wait it would run alone while the others' calls
travel, and they would get every other step only).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

from workers.protocol import UNFINISHED, Timings

log = logging.getLogger(__name__)

C = TypeVar("C")  # a call (VerifyCall, ProposeCall)
R = TypeVar("R")  # its result (VerifyOutcome, TokenTree)


class EngineThread:
    """The one thread that runs forwards and touches the session table."""

    def __init__(self, name: str = "engine"):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._executor.shutdown(wait=True)


@dataclass(frozen=True)
class BatchReport:
    """One step, for metrics."""

    size: int  # calls in the batch
    cost: int  # their summed cost (tokens)
    queue_ns: list[int]  # per call: arrival -> step start
    forward_ns: int  # the step's duration


@dataclass
class _Queued(Generic[C]):
    call: C
    key: str
    cost: int
    arrived_ns: int
    future: asyncio.Future
    passed_over: bool = False  # left out of a batch (its session was in it, or it was full)
    patient: bool = False  # an unfinished call: waits for the others as long as a step lasts


class Batcher(Generic[C, R]):
    def __init__(
        self,
        step: Callable[[list[C]], Sequence[R | Exception]],
        thread: EngineThread,
        *,
        key: Callable[[C], str],
        cost: Callable[[C], int],
        wait_s: float = 0.002,
        wait_share: float = 0.0,
        max_tokens: int = 2048,
        on_batch: Callable[[BatchReport], None] = lambda report: None,
        held_sessions: Callable[[], Collection[str]] | None = None,
        fed: Callable[[], float] | None = None,
    ):
        self.step = step  # the runner's batched method; one result or exception per call
        self.thread = thread
        self.key = key  # the session of a call; one call per session per batch
        self.cost = cost  # the tokens a call feeds, roughly
        self.wait_ns = int(wait_s * 1e9)  # a call waits at least this long for others to join
        self.wait_share = wait_share  # ... or this share of the previous step's duration
        self.max_tokens = max_tokens  # a batch stops growing at this summed cost
        self.on_batch = on_batch
        # the sessions the worker holds that may call again soon (None: unknown); a session
        # of the previous step not among them (ended, or its generation over:
        # TargetRunner.due_sessions) is not waited for
        self.held_sessions = held_sessions
        # the work the worker's forwards have done so far, in tokens fed for their logits
        # (a running total; WorkerMetrics.fed_work): a step's Timings report what its
        # forwards fed, after the prefix cache's hits and without the chunks of a long
        # prompt left for later. None: the calls' summed cost
        self.fed = fed
        self.batches = 0  # steps run
        self.largest = 0  # most calls in one step
        self._queue: deque[_Queued[C]] = deque()
        self._queued_cost = 0
        self._ready = asyncio.Event()  # the queue is not empty
        self._full = asyncio.Event()  # the queue holds max_tokens
        self._task: asyncio.Task | None = None
        self._last_end_ns = 0  # when the previous step ended
        self._last_step_ns = 0  # how long it took
        self._expected: set[str] = set()  # its sessions: each calls again a round trip later
        self.patience = True  # unfinished calls wait for the others (off once draining)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="batcher")

    def drain(self) -> None:
        """From now on run queued calls at once, without waiting for others to join."""
        self.wait_ns = 0
        self.wait_share = 0.0
        self.patience = False
        self._full.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for q in self._queue:
            if not q.future.done():
                q.future.set_exception(RuntimeError("the worker is shutting down"))
        self._queue.clear()

    async def submit(self, call: C) -> tuple[R, Timings]:
        """Queues one call; returns its result and timings, or raises its exception."""
        future = asyncio.get_running_loop().create_future()
        cost = max(1, self.cost(call))
        self._queue.append(_Queued(call, self.key(call), cost, time.perf_counter_ns(), future))
        self._queued_cost += cost
        self._ready.set()
        if self._queued_cost >= self.max_tokens or self._everyone_back():
            self._full.set()
        return await future

    def _everyone_back(self) -> bool:
        """Every session of the previous step (still held) has its next call queued: nobody
        else is due, so waiting is pure latency (one stream alone). With no previous step
        (the first calls, or its sessions all ended) the window runs its course."""
        if not self._queue or not self._expected:
            return False
        expected = self._expected
        if self.held_sessions is not None:
            try:
                expected = expected & set(self.held_sessions())  # the engine thread may change it
            except RuntimeError:
                return False
        return bool(expected) and expected <= {q.key for q in self._queue}

    async def _run(self) -> None:
        while True:
            await self._ready.wait()
            if not self._queue:
                self._ready.clear()
                continue
            try:
                await self._gather()
                batch = self._take()
                if batch:
                    await self._step(batch)
            except Exception:  # noqa: BLE001 - the queue must outlive any bug in one step
                log.exception("batch step failed")

    async def _gather(self) -> None:
        """Waits until the window after the oldest call and the last step has passed, or
        the queue is full, or everyone is back."""
        oldest = self._queue[0]
        since = max(oldest.arrived_ns, self._last_end_ns)
        if oldest.patient and self.patience:
            wait_ns = max(self.wait_ns, self._last_step_ns)
        else:
            wait_ns = max(self.wait_ns, int(self.wait_share * self._last_step_ns))
        left_ns = since + wait_ns - time.perf_counter_ns()
        full = self._queued_cost >= self.max_tokens or self._everyone_back()
        if left_ns <= 0 or oldest.passed_over or full:
            return
        self._full.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._full.wait(), left_ns / 1e9)

    def _take(self) -> list[_Queued[C]]:
        """The oldest calls up to max_tokens (at least one), one per session."""
        batch: list[_Queued[C]] = []
        keys: set[str] = set()
        cost = 0
        rest: deque[_Queued[C]] = deque()
        while self._queue:
            q = self._queue.popleft()
            if q.future.done():  # the caller went away (cancelled, deadline)
                self._queued_cost -= q.cost
            elif q.key in keys or (batch and cost + q.cost > self.max_tokens):
                q.passed_over = True
                rest.append(q)
            else:
                batch.append(q)
                keys.add(q.key)
                cost += q.cost
                self._queued_cost -= q.cost
        self._queue = rest
        if not self._queue:
            self._ready.clear()
        return batch

    async def _step(self, batch: list[_Queued[C]]) -> None:
        start = time.perf_counter_ns()
        fed_before = self.fed() if self.fed is not None else 0
        try:
            results = await self.thread.run(self.step, [q.call for q in batch])
        except Exception as error:  # noqa: BLE001 - the whole step failed: every call gets it
            log.exception("batch of %d calls failed", len(batch))
            results = [error] * len(batch)
        self._last_end_ns = time.perf_counter_ns()
        forward_ns = self._last_step_ns = self._last_end_ns - start
        self._expected = {q.key for q in batch}
        self.batches += 1
        self.largest = max(self.largest, len(batch))
        again = [q for q, result in zip(batch, results, strict=True) if result is UNFINISHED]
        for q in reversed(again):
            q.passed_over, q.patient = False, True
            self._queue.appendleft(q)
            self._queued_cost += q.cost
        if again:
            self._ready.set()
        cost = sum(q.cost for q in batch)
        tokens = max(1, round(self.fed() - fed_before)) if self.fed is not None else cost
        for q, result in zip(batch, results, strict=True):
            if q.future.done() or result is UNFINISHED:
                continue
            if isinstance(result, Exception):
                q.future.set_exception(result)
            else:
                timings = Timings(start - q.arrived_ns, forward_ns, len(batch), tokens)
                q.future.set_result((result, timings))
        queue_ns = [start - q.arrived_ns for q in batch]
        self.on_batch(BatchReport(len(batch), cost, queue_ns, forward_ns))
