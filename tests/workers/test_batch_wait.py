"""The batching window closes early once every session the worker holds has a call queued."""

import asyncio
import time

import pytest

from workers.rpc.batcher import Batcher, EngineThread


async def run(held: list[str], calls: list[str], timeout: float = 10) -> list[list[str]]:
    seen: list[list[str]] = []

    def step(batch: list[str]) -> list[str]:
        seen.append(list(batch))
        return batch

    thread = EngineThread()
    # a window far longer than the test: only the live-session rule can close it
    batcher = Batcher(
        step, thread, key=lambda c: c, cost=len, wait_s=600, held_sessions=lambda: held
    )
    batcher.start()
    try:
        await asyncio.wait_for(asyncio.gather(*(batcher.submit(c) for c in calls)), timeout)
    finally:
        await batcher.close()
        thread.close()
    return seen


async def test_a_session_alone_does_not_wait():
    assert await run(["a"], ["a"]) == [["a"]]


async def test_every_held_session_queued_closes_the_batch():
    assert await run(["a", "b"], ["a", "b"]) == [["a", "b"]]


async def test_a_new_session_waits_for_others():
    with pytest.raises(TimeoutError):
        await run(["a"], ["b"], timeout=0.5)  # "b" is not held yet: it waits the (600 s) window


async def test_sessions_out_of_phase_merge_again():
    """A call queued during a step waits for that step's sessions to call again.

    "a" runs alone; "b" arrives during a's step, older than the window when the
    step ends. Counting the window from the step's end lets "a" (back 10 ms
    later) join "b" instead of the two alternating in batches of one."""
    held = ["a"]
    seen: list[list[str]] = []

    def step(batch: list[str]) -> list[str]:
        seen.append(sorted(batch))
        time.sleep(0.1)
        return batch

    async def session(name: str, delay: float) -> None:
        await asyncio.sleep(delay)
        if name not in held:
            held.append(name)
        for _ in range(4):
            await batcher.submit(name)
            await asyncio.sleep(0.01)  # the gateway's round trip

    thread = EngineThread()
    batcher = Batcher(
        step, thread, key=lambda c: c, cost=len, wait_s=0.05, held_sessions=lambda: held
    )
    batcher.start()
    try:
        await asyncio.wait_for(asyncio.gather(session("a", 0), session("b", 0.02)), 10)
    finally:
        await batcher.close()
        thread.close()
    assert seen[0] == ["a"]
    assert seen[1:4] == [["a", "b"]] * 3
