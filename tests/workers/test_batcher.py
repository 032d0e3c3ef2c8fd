"""The batching queue on its own: merging, the token bound, one call per session, errors."""

import asyncio

import pytest

from workers.rpc.batcher import Batcher, EngineThread


def fake_step(batches: list[list[str]]):
    """Records each batch; 'bad' calls fail on their own, 'crash' fails the whole step."""

    def step(calls: list[str]) -> list:
        batches.append(list(calls))
        if "crash" in calls:
            raise RuntimeError("the whole step failed")
        return [ValueError(c) if c.startswith("bad") else c.upper() for c in calls]

    return step


@pytest.fixture
async def batches():
    seen: list[list[str]] = []
    thread = EngineThread()
    # a window far longer than the test: batches close because they are full, not by time
    batcher = Batcher(
        fake_step(seen), thread, key=lambda c: c[-1], cost=len, wait_s=600, max_tokens=6
    )
    batcher.start()
    yield batcher, seen
    await batcher.close()
    thread.close()


async def test_calls_merge_up_to_the_token_bound_one_per_session(batches):
    batcher, seen = batches
    calls = ["a1", "b2", "c1", "d3"]  # sessions 1, 2, 1, 3; cost 2 each; max 6 per batch
    results = await asyncio.gather(*(batcher.submit(c) for c in calls))
    assert [r for r, _ in results] == ["A1", "B2", "C1", "D3"]
    assert seen == [["a1", "b2", "d3"], ["c1"]]  # c1 waits for session 1's next batch
    assert [t.batch_size for _, t in results] == [3, 3, 1, 3]
    assert batcher.largest == 3 and batcher.batches == 2


async def test_errors_reach_only_their_callers(batches):
    batcher, _ = batches
    good, bad, other = await asyncio.gather(
        batcher.submit("ok1"), batcher.submit("bad2"), batcher.submit("x3"), return_exceptions=True
    )
    assert good[0] == "OK1" and other[0] == "X3"
    assert isinstance(bad, ValueError)


async def test_a_failed_step_fails_its_calls_and_the_queue_lives_on(batches):
    batcher, seen = batches
    failed = await asyncio.gather(
        batcher.submit("crash"), batcher.submit("q"), return_exceptions=True
    )
    assert all(isinstance(r, RuntimeError) for r in failed)
    batcher.drain()  # a lone small call would otherwise wait out the window
    assert (await batcher.submit("y2"))[0] == "Y2"
