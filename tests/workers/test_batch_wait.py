"""The batching window closes early once every session the worker holds has a call queued."""

import asyncio

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
