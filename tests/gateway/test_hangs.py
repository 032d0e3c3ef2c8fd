"""Hangs fail over as fast as crashes (gateway/hangs.py): the bound from a worker's own
recent calls, a stalled target behind the real gateway, with one target and with two, and
a draft that hangs under the overlapped loop's look-ahead."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway import hangs
from gateway.hangs import CallTimes, Hung
from tests.gateway.helpers import live, slow_target, stalling_draft, target
from tests.gateway.test_routing import CHAT, client_of, stream_text

TREE_DEPTH = 4


def test_no_bound_until_the_worker_answered_enough_calls():
    times = CallTimes()
    for _ in range(hangs.MIN_CALLS - 1):
        times.rates.append(0.001)
    assert times.bound(10) is None
    times.rates.append(0.001)
    assert times.bound(10) == hangs.FLOOR_S  # 4 x 1 ms x 10 tokens is below the floor


def test_the_bound_grows_with_the_tokens_and_the_slowest_recent_rate():
    times = CallTimes()
    times.rates.extend([0.001] * 98 + [0.01] * 2)  # 2 slow calls in 100 set the p99
    assert times.bound(1000) == pytest.approx(hangs.FACTOR * 0.01 * 1000)
    times.rates.extend([0.001] * hangs.WINDOW)  # the slow ones left the window
    assert times.bound(1000) == pytest.approx(hangs.FACTOR * 0.001 * 1000)


def test_a_call_past_its_bound_is_cancelled_and_one_within_it_is_timed():
    async def run() -> None:
        times = CallTimes()
        times.rates.extend([0.001] * hangs.MIN_CALLS)
        cancelled = asyncio.Event()

        async def hang():
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        assert await times.timed(asyncio.sleep(0, "ok"), 5, bounded=True) == "ok"
        assert len(times.rates) == hangs.MIN_CALLS + 1 and times.in_flight == 0
        with pytest.raises(Hung):
            await times.timed(hang(), 5, bounded=True)
        assert cancelled.is_set() and times.in_flight == 0

    asyncio.run(run())


def stall_the_busy_target_once_warm(gateway, backends, stall_s: float, stalled: list):
    """An on_chunk callback: once the target serving the stream has answered enough calls
    for a bound, its next verify stalls for stall_s."""

    def on_chunk(_: int) -> None:
        workers = gateway.gateway.router.targets.workers
        busy = next((w for w in workers.values() if w.load > 0), None)
        if stalled or busy is None or len(busy.times.rates) < hangs.MIN_CALLS:
            return
        next(b for b in backends if b.address == busy.address).stall_s = stall_s
        stalled.append(busy.address)

    return on_chunk


WARM_UP = 3  # requests before the one that stalls: each target answers MIN_CALLS calls


def test_a_hung_target_fails_over_to_the_other_one_with_the_same_text(tiny_dir):
    backends = [slow_target(tiny_dir, "t0", 0.01), slow_target(tiny_dir, "t1", 0.01)]
    kw = dict(messages=CHAT, max_tokens=48, temperature=0)
    # no suffix cache in either test: a repeated greedy request would draft its whole answer
    # from the first one's output, in too few calls for the stall rule to arm; and a few
    # requests first, as a round without a draft decodes up to four tokens a call
    with live(tiny_dir, backends, rpc_timeout_s=120, suffix_cache_tokens=0) as gateway:
        client = client_of(gateway)
        clean = stream_text(client, **kw)
        for _ in range(WARM_UP):  # the least-loaded pick alternates: both targets are warm
            stream_text(client, **kw)
        stalled: list[str] = []
        on_chunk = stall_the_busy_target_once_warm(gateway, backends, 60, stalled)
        faulted = stream_text(client, on_chunk=on_chunk, **kw)
        assert stalled
        assert faulted == clean
        metrics = httpx.get(gateway.url + "/metrics").text
        assert 'specsplit_hung_calls_total{role="target"} 1.0' in metrics
        assert 'specsplit_failovers_total{role="target"} 1.0' in metrics


def test_with_one_target_a_slow_call_is_waited_for(tiny_dir):
    backends = [slow_target(tiny_dir, "t0", 0.01)]
    kw = dict(messages=CHAT, max_tokens=48, temperature=0)
    with live(tiny_dir, backends, suffix_cache_tokens=0) as gateway:
        client = client_of(gateway)
        clean = stream_text(client, **kw)
        for _ in range(WARM_UP):
            stream_text(client, **kw)
        stalled: list[str] = []
        on_chunk = stall_the_busy_target_once_warm(gateway, backends, 2 * hangs.FLOOR_S, stalled)
        assert stream_text(client, on_chunk=on_chunk, **kw) == clean
        assert stalled
        metrics = httpx.get(gateway.url + "/metrics").text
        assert 'specsplit_hung_calls_total{role="target"} 0.0' in metrics
        assert 'specsplit_failovers_total{role="target"} 0.0' in metrics


def test_a_draft_that_hangs_under_a_lookahead_fails_over_with_the_same_text(
    tiny_dir, tiny_draft_dir
):
    """With the overlapped loop a look-ahead propose starts before a verify and is awaited
    after it: one to a hung draft is bounded like any propose, and the session moves to
    the other draft. The draft hangs on look-aheads only (drafted a level deeper than the
    configured tree), so nothing else could trip the bound."""
    drafts = [stalling_draft(tiny_draft_dir, "d0"), stalling_draft(tiny_draft_dir, "d1")]
    for draft in drafts:
        draft.stall_deeper_than = TREE_DEPTH
    kw = dict(messages=CHAT, max_tokens=48, temperature=0)
    settings = dict(overlap_draft=True, adaptive_tree=False, rpc_timeout_s=600)
    settings.update(tree_depth=TREE_DEPTH)
    with live(tiny_dir, [target(tiny_dir), *drafts], suffix_cache_tokens=0, **settings) as gateway:
        client = client_of(gateway)
        clean = stream_text(client, **kw)
        workers = gateway.gateway.router.drafts.workers.values()
        for _ in range(8):  # until both drafts answered enough calls for a bound
            if all(len(w.times.rates) >= hangs.MIN_CALLS for w in workers):
                break
            assert stream_text(client, **kw) == clean
        stalled: list[str] = []

        def on_chunk(_: int) -> None:
            busy = next((w for w in workers if w.load > 0), None)
            if stalled or busy is None:
                return
            next(d for d in drafts if d.address == busy.address).stall_s = 600
            stalled.append(busy.address)

        assert stream_text(client, on_chunk=on_chunk, **kw) == clean
        hung = next(d for d in drafts if d.address == stalled[0])
        assert hung.cancelled >= 1
        metrics = httpx.get(gateway.url + "/metrics").text
        assert 'specsplit_hung_calls_total{role="draft"} 1.0' in metrics
        assert 'specsplit_failovers_total{role="draft"} 1.0' in metrics
