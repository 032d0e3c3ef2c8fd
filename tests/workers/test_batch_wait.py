"""The batching window closes early once every session of the previous batch has a call queued;
it lasts a share of the previous batch's duration."""

import asyncio
import time

import pytest

from workers.rpc.batcher import Batcher, EngineThread


async def run(
    held: list[str], rounds: list[list[str]], first: list[str] | None = None, timeout: float = 0.5
) -> list[list[str]]:
    """`first` run as one batch at once (as on a drain), then each round's calls submitted
    together once the previous round is answered, under a window far longer than the
    test: only the everyone-back rule can close it early."""
    seen: list[list[str]] = []

    def step(batch: list[str]) -> list[str]:
        seen.append(sorted(batch))
        return batch

    thread = EngineThread()
    batcher = Batcher(
        step, thread, key=lambda c: c, cost=len, wait_s=600, held_sessions=lambda: held
    )
    batcher.start()
    try:
        if first:
            batcher.wait_ns = 0
            await asyncio.gather(*(batcher.submit(c) for c in first))
            batcher.wait_ns = int(600e9)
        for calls in rounds:
            await asyncio.wait_for(asyncio.gather(*(batcher.submit(c) for c in calls)), timeout)
    finally:
        await batcher.close()
        thread.close()
    return seen


async def test_a_first_batch_waits_its_window():
    with pytest.raises(TimeoutError):
        await run(["a"], [["a"]])  # nobody was in a previous batch: who else comes?


async def test_a_session_alone_does_not_wait():
    assert await run(["a"], [["a"]] * 3, first=["a"]) == [["a"]] * 4


async def test_every_session_of_the_previous_batch_back_closes_the_batch():
    assert await run(["a", "b"], [["a", "b"]] * 2, first=["a", "b"]) == [["a", "b"]] * 3


async def test_a_session_no_longer_held_is_not_waited_for():
    # "b" was in the previous batch but the worker ended it: "a" alone does not wait
    assert await run(["a"], [["a"]], first=["a", "b"]) == [["a", "b"], ["a"]]


async def test_a_session_of_the_previous_batch_is_waited_for():
    with pytest.raises(TimeoutError):
        await run(["a", "b"], [["a"]], first=["a", "b"])  # "b" is due back: "a" waits


async def paced(
    step_s: float, wait_s: float, share: float, sessions: dict[str, tuple[float, float]]
) -> list[list[str]]:
    """Sessions {name: (start, round trip)} of four calls each against steps of `step_s`
    seconds; a session is held from its start. Returns the batches."""
    held: list[str] = []
    seen: list[list[str]] = []

    def step(batch: list[str]) -> list[str]:
        seen.append(sorted(batch))
        time.sleep(step_s)
        return batch

    async def session(name: str, start: float, round_trip: float) -> None:
        await asyncio.sleep(start)
        held.append(name)
        for _ in range(4):
            await batcher.submit(name)
            await asyncio.sleep(round_trip)

    thread = EngineThread()
    batcher = Batcher(
        step,
        thread,
        key=lambda c: c,
        cost=len,
        wait_s=wait_s,
        wait_share=share,
        held_sessions=lambda: held,
    )
    batcher.start()
    try:
        runs = (session(name, *pace) for name, pace in sessions.items())
        await asyncio.wait_for(asyncio.gather(*runs), 20)
    finally:
        await batcher.close()
        thread.close()
    return seen


async def test_the_window_is_a_share_of_the_previous_step():
    """A late session still joins when its round trip is longer than wait_s but shorter
    than the share of the step; with the share at 0 it misses every other batch."""
    sessions = {"a": (0.0, 0.0), "b": (0.0, 0.03)}
    assert await paced(0.2, 0.005, 0.5, sessions) == [["a", "b"]] * 4
    assert len(await paced(0.2, 0.005, 0.0, sessions)) > 4


async def test_sessions_out_of_phase_merge_again():
    """A call queued during a step waits for that step's sessions to call again.

    "a" runs alone after its window; "b" arrives during a's step, older than the
    window when the step ends. Counting the window from the step's end lets "a"
    (back 10 ms later) join "b" instead of the two alternating in batches of one."""
    seen = await paced(0.1, 0.05, 0.0, {"a": (0.0, 0.01), "b": (0.08, 0.01)})
    assert seen[0] == ["a"]
    assert seen[1:4] == [["a", "b"]] * 3
