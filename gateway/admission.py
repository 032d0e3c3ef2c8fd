"""The admission queue: requests beyond capacity wait their turn, in order.

A request needs one live session per choice. `Admissions.admit(n)` returns at
once when the router has room for n more and nobody waits ahead; otherwise
the request joins a FIFO of waiters. Each release hands the freed room to the
waiters at the head, strictly in order: a head needing n > 1 sessions blocks
the ones behind it until n fit, so a big request is never starved by small
ones. A request is refused with 429 only when `max_waiting` requests already
wait (`queue_full`) or when it waited `max_wait_s` (`queue_timeout`); with
`max_waiting` 0 nothing waits. 503 (no healthy target) and 400 (more choices
than the server holds) stay immediate: waiting would not help. A waiter whose
client goes away is cancelled and leaves the queue.

Retry-After is an estimate, not a constant: sessions free up at about
`capacity / hold` per second, where `hold` is the mean time the last
`HOLD_WINDOW` requests held their sessions, so the sessions needed by the
waiters ahead plus the request's own take `needed * hold / capacity` seconds.
Before any request has finished, the router's health interval stands in.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from dataclasses import dataclass, field

from gateway.errors import APIError
from gateway.metrics import Metrics
from gateway.pool import Admission, Router

HOLD_WINDOW = 64  # finished requests whose hold times make the Retry-After estimate
RECHECK_S = 1.0  # waiters re-check room this often (a target that comes back adds room)


@dataclass(eq=False)
class Waiter:
    n: int  # sessions it needs
    future: asyncio.Future[Admission]


@dataclass
class Admissions:
    """The line of requests waiting for sessions, in front of the router's capacity."""

    router: Router
    metrics: Metrics
    max_waiting: int = 256  # requests that may wait at once; 0 = refuse at capacity
    max_wait_s: float = 300.0  # longest wait before 429
    waiters: deque[Waiter] = field(default_factory=deque)
    holds: deque[float] = field(default_factory=lambda: deque(maxlen=HOLD_WINDOW))
    running: int = 0  # requests admitted and not released

    async def admit(self, n: int) -> Admission:
        """Reserves n live sessions, waiting in line when there is no room (see module doc)."""
        arrived = time.monotonic()
        self.wake()  # room may have grown since the last release (a target came back)
        if not self.waiters and self.router.room(n):
            admission = self.reserve(n)
        else:
            admission = await self.queue(n, arrived)
        self.metrics.request_queue_time.observe(time.monotonic() - arrived)
        return admission

    async def queue(self, n: int, arrived: float) -> Admission:
        if len(self.waiters) >= self.max_waiting:
            raise self.refusal(
                "queue_full",
                f"the queue is full ({len(self.waiters)} of {self.max_waiting} waiting)",
                self.sessions_ahead() + n,
            )
        waiter = Waiter(n, asyncio.get_running_loop().create_future())
        self.waiters.append(waiter)
        self.count_waiting()
        try:
            return await self.wait(waiter, arrived)
        finally:
            self.leave(waiter)

    async def wait(self, waiter: Waiter, arrived: float) -> Admission:
        deadline = arrived + self.max_wait_s
        try:
            while not waiter.future.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self.refusal(
                        "queue_timeout",
                        f"waited {self.max_wait_s:g} s for a session",
                        self.sessions_ahead(waiter) + waiter.n,
                    )
                await asyncio.wait({waiter.future}, timeout=min(left, RECHECK_S))
                self.wake()
        except asyncio.CancelledError:  # the client went away
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().release()  # admitted as it left: give the room back
            raise
        return waiter.future.result()

    def leave(self, waiter: Waiter) -> None:
        with contextlib.suppress(ValueError):
            self.waiters.remove(waiter)
        if not waiter.future.done():
            waiter.future.cancel()
        self.count_waiting()

    def wake(self) -> None:
        """Hands the room there is to the waiters at the head, in order."""
        while self.waiters:
            head = self.waiters[0]
            try:
                if not self.router.room(head.n):
                    break
            except APIError as error:  # no target left, or fewer sessions than it needs
                self.waiters.popleft()
                head.future.set_exception(error)
                continue
            self.waiters.popleft()
            head.future.set_result(self.reserve(head.n))
        self.count_waiting()

    def reserve(self, n: int) -> Admission:
        admission = self.router.reserve(n, self.released)
        self.running += 1
        self.metrics.requests_running.set(self.running)
        return admission

    def released(self, admission: Admission) -> None:
        self.holds.append(time.monotonic() - admission.since)
        self.running -= 1
        self.metrics.requests_running.set(self.running)
        self.wake()

    def sessions_ahead(self, waiter: Waiter | None = None) -> int:
        ahead = 0
        for w in self.waiters:
            if w is waiter:
                break
            ahead += w.n
        return ahead

    def retry_after(self, sessions: int) -> int:
        """Seconds until `sessions` more have been freed, at the recent rate (module doc)."""
        if not self.holds:
            return self.router.retry_after_s
        hold = sum(self.holds) / len(self.holds)
        return max(1, math.ceil(sessions * hold / max(1, self.router.capacity())))

    def refusal(self, code: str, why: str, sessions: int) -> APIError:
        live, capacity = self.router.live, self.router.capacity()
        return APIError(
            429,
            f"too many concurrent requests: {why}; {live} sessions live, capacity {capacity}",
            None,
            code,
            self.retry_after(sessions),
        )

    def count_waiting(self) -> None:
        self.metrics.requests_waiting.set(len(self.waiters))
