"""Supervision of `specsplit serve`'s worker processes.

A worker process that exits (a crash, the OOM killer, a stray `kill -9`) is
started again on the same address, with the same credentials, after a
backoff: `first_s`, doubling at each exit in a row, capped at `max_s`; a
worker that stayed up `stable_s` counts as recovered, and its next exit waits
`first_s` again. So a worker that cannot start (a bad model path) is retried
at most every `max_s`, never in a spin. The gateway's pool entry for that
address recovers through its usual health checks (gateway/pool.py), and the
restart is logged and counted in `specsplit_worker_restarts_total{role}`.

Supervision ends when serve starts to shut down, so the drain never restarts
the workers it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import Counter

log = logging.getLogger("specsplit.serve")

POLL_S = 0.2  # how often a child's exit is looked for


@dataclass(frozen=True)
class Backoff:
    first_s: float = 1.0  # wait before the first restart after a stable run
    max_s: float = 30.0  # the longest wait, however many exits in a row
    stable_s: float = 60.0  # up this long, a worker counts as recovered

    def delay_s(self, exits_in_a_row: int) -> float:
        return min(self.max_s, self.first_s * 2 ** (exits_in_a_row - 1))


@dataclass(frozen=True)
class Child:
    """A worker process of serve."""

    role: str
    address: str
    process: subprocess.Popen
    started: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.process.pid

    def summary(self) -> dict:
        return {"role": self.role, "address": self.address, "pid": self.pid}


class Supervisor:
    """Keeps each of `children` running, replacing an entry of the list in place by what
    `restart(child)` starts on its address."""

    def __init__(
        self,
        children: list[Child],
        restart: Callable[[Child], Child],
        backoff: Backoff,
        restarts: Counter,
        on_restart: Callable[[], None] = lambda: None,
    ):
        self.children = children
        self.restart = restart
        self.backoff = backoff
        self.restarts = restarts  # labelled by role
        self.on_restart = on_restart
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self.tasks = [
            asyncio.create_task(self.keep(i), name=f"supervise-{child.role}-{child.address}")
            for i, child in enumerate(self.children)
        ]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.tasks = []

    async def keep(self, index: int) -> None:
        exits = 0  # in a row, each within stable_s of its start
        while True:
            child = self.children[index]
            while child.process.poll() is None:
                await asyncio.sleep(POLL_S)
            up_s = time.monotonic() - child.started
            exits = 1 if up_s >= self.backoff.stable_s else exits + 1
            log.warning(
                "%s worker pid %d on %s exited with %s after %.1f s: restart in %.3g s "
                "(exit %d in a row)",
                child.role, child.pid, child.address, child.process.returncode, up_s,
                self.backoff.delay_s(exits), exits,
            )  # fmt: skip
            while True:
                await asyncio.sleep(self.backoff.delay_s(exits))
                try:
                    self.children[index] = self.restart(child)
                    break
                except OSError as error:  # not even spawned: wait longer, try again
                    log.error("%s worker on %s did not start: %s", child.role, child.address, error)
                    exits += 1
            self.restarts.labels(child.role).inc()
            self.on_restart()
