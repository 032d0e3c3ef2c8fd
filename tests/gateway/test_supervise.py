"""gateway/supervise.py on real child processes (`sh -c 'exit N'`); serve's own supervision of
real workers is in tests/chaos/test_serve_faults.py."""

from __future__ import annotations

import asyncio
import logging
import re
import subprocess
import time

from prometheus_client import CollectorRegistry, Counter

from gateway.supervise import Backoff, Child, Supervisor

FAST = Backoff(first_s=0.01, max_s=0.04, stable_s=60.0)


def test_backoff_doubles_up_to_its_cap():
    assert [Backoff(1.0, 30.0).delay_s(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


def failing(role: str = "target", address: str = "127.0.0.1:1") -> Child:
    return Child(role, address, subprocess.Popen(["sh", "-c", "exit 3"]))


def supervisor(children: list[Child], backoff: Backoff = FAST) -> Supervisor:
    restarts = Counter("restarts", "restarts", ["role"], registry=CollectorRegistry())
    spawned: list[Child] = []

    def restart(child: Child) -> Child:
        spawned.append(failing(child.role, child.address))
        return spawned[-1]

    return Supervisor(children, restart, backoff, restarts)


def restarted(sup: Supervisor, role: str = "target") -> float:
    return sup.restarts.labels(role)._value.get()


def waits(caplog) -> list[tuple[float, int]]:
    """(restart wait in s, exits in a row) of each restart logged."""
    pattern = re.compile(r"restart in ([\d.]+) s \(exit (\d+) in a row\)")
    found = [pattern.search(r.getMessage()) for r in caplog.records]
    return [(float(m[1]), int(m[2])) for m in found if m]


def test_a_crash_loop_backs_off_to_the_cap_on_the_same_address(caplog):
    caplog.set_level(logging.WARNING, "specsplit.serve")
    children = [failing()]
    first = children[0]

    async def run() -> None:
        sup = supervisor(children)
        sup.start()
        deadline = time.monotonic() + 10
        while restarted(sup) < 5 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await sup.stop()

    asyncio.run(run())
    assert waits(caplog)[:5] == [(0.01, 1), (0.02, 2), (0.04, 3), (0.04, 4), (0.04, 5)]
    assert children[0] is not first and children[0].address == first.address  # in place


def test_a_worker_that_stayed_up_starts_over_at_the_first_wait(caplog):
    caplog.set_level(logging.WARNING, "specsplit.serve")
    stable = failing()
    stable = Child(stable.role, stable.address, stable.process, started=time.monotonic() - 61)

    async def run() -> None:
        sup = supervisor([stable])
        sup.start()
        while restarted(sup) < 1:
            await asyncio.sleep(0.01)
        await sup.stop()

    asyncio.run(run())
    assert waits(caplog)[0] == (0.01, 1)


def test_stopping_during_the_backoff_restarts_nothing():
    children = [failing("draft")]

    async def run() -> Supervisor:
        sup = supervisor(children, Backoff(first_s=30.0))
        sup.start()
        while children[0].process.poll() is None:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # it saw the exit and waits its 30 s
        await sup.stop()
        return sup

    assert restarted(asyncio.run(run()), "draft") == 0
    assert len(children) == 1 and children[0].process.returncode == 3
