"""Hung calls fail over as fast as crashed ones.

A worker that crashes fails its call at once; one that hangs (a GC pause, a
stuck driver, a stopped process) would hold the round until the call's
deadline (`--rpc-timeout-s`, 60 s). So the gateway bounds each propose and
verify call by the worker's own recent calls:

    bound = max(FLOOR_S, FACTOR * p99(recent seconds per token) * tokens)

A call's `tokens` are what it asks the worker to process (the history it
sends plus the tree's nodes) plus those of this gateway's other calls in
flight on the same worker when it starts: a long prefill, or a decode
batched with one, gets a proportionally longer bound. Seconds per token are
measured the same way (a call's time over its tokens so counted), over the
worker's last WINDOW answered calls.

A call past its bound is cancelled and fails as WorkerDown: the loop then
does what it does after a crash (the worker is marked down until its next
health check passes, the round goes to another worker with the full
history, token-exact). The bound applies only
- once the worker answered MIN_CALLS calls (a cold first call or a first
  long prefill is never taken for a hang), and
- while another worker of the role is serving: with one target only there
  is nowhere to go, so the call waits as it always did (up to its deadline).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from workers.protocol import WorkerDown

FACTOR = 4.0  # a hang takes this many times the worker's slowest recent rate ...
QUANTILE = 0.99  # ... taken as this quantile of its recent calls
FLOOR_S = 1.0  # never sooner than this (scheduler hiccups, a loaded host)
WINDOW = 128  # recent calls remembered per worker
MIN_CALLS = 16  # answered calls before the bound applies

T = TypeVar("T")


class Hung(WorkerDown):
    """A call ran past its worker's hang bound and was cancelled."""


@dataclass
class CallTimes:
    """One worker's recent calls as this gateway saw them."""

    rates: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))  # s per token
    in_flight: int = 0  # tokens of this gateway's calls the worker is processing now

    def bound(self, tokens: int) -> float | None:
        """Seconds a call of `tokens` (in flight ones included) may take; None = no bound yet."""
        if len(self.rates) < MIN_CALLS:
            return None
        ordered = sorted(self.rates)
        rate = ordered[min(len(ordered) - 1, int(QUANTILE * len(ordered)))]
        return max(FLOOR_S, FACTOR * rate * tokens)

    async def timed(self, call: Awaitable[T], tokens: int, bounded: bool) -> T:
        """Awaits the call and remembers its rate; raises Hung past the bound when `bounded`."""
        tokens = max(tokens, 1)
        self.in_flight += tokens
        load = self.in_flight
        try:
            bound = self.bound(load) if bounded else None
            start = time.perf_counter()
            try:
                result = await asyncio.wait_for(call, bound)
            except TimeoutError:
                raise Hung(f"no answer within {bound:.2f} s, its hang bound") from None
            self.rates.append((time.perf_counter() - start) / load)
            return result
        finally:
            self.in_flight -= tokens
