"""The admission queue: order, bounds, Retry-After, cancelled waiters, and the gateway over it.

The first tests drive `Admissions` over a real Router and Pool of a tiny in-process target;
the last ones a live gateway through the OpenAI SDK, where a slow target keeps sessions busy.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest
from openai import OpenAI

from gateway.admission import Admissions
from gateway.errors import APIError
from gateway.metrics import Metrics
from gateway.pool import Pool, Router
from tests.gateway.helpers import MODEL, SlowTarget, live, slow_target, target, wait_until
from workers.loop.inprocess import InProcessFactory


@pytest.fixture
async def router(tiny_dir):
    """A Router holding 2 sessions over one tiny target that holds 4."""
    metrics = Metrics()
    pool = Pool("target", ["t0"], InProcessFactory([target(tiny_dir, "t0")]), metrics)
    await pool.start()
    yield Router(pool, None, metrics, max_sessions=2)
    await pool.close()


async def settle(condition) -> None:
    """Lets the other tasks run until `condition()` holds."""
    for _ in range(100):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the tasks did not get there")


def gauge(router: Router, name: str) -> float:
    return router.metrics.registry.get_sample_value(name)


async def test_waiters_are_served_in_order_and_a_big_head_blocks_the_rest(router):
    admissions = Admissions(router, router.metrics, max_waiting=4, max_wait_s=30)
    first = await admissions.admit(1)
    big = asyncio.create_task(admissions.admit(2))
    small = asyncio.create_task(admissions.admit(1))
    await settle(lambda: len(admissions.waiters) == 2)
    assert router.room(1) and not small.done()  # room for one, but it waits behind the big one
    assert gauge(router, "specsplit_num_requests_waiting") == 2

    first.release()
    await settle(big.done)
    assert not small.done() and router.live == 2
    (await big).release()
    await settle(small.done)
    (await small).release()
    assert router.live == 0 and not admissions.waiters
    assert gauge(router, "specsplit_num_requests_running") == 0
    assert gauge(router, "specsplit_num_requests_waiting") == 0
    assert gauge(router, "specsplit_request_queue_time_seconds_count") == 3


async def test_a_full_queue_refuses_at_once_with_an_estimated_retry_after(router):
    admissions = Admissions(router, router.metrics, max_waiting=1, max_wait_s=30)
    held = await admissions.admit(2)
    waiting = asyncio.create_task(admissions.admit(1))
    await settle(lambda: len(admissions.waiters) == 1)
    admissions.holds.extend([3.0, 5.0])  # recent requests held their sessions 4 s on average
    with pytest.raises(APIError) as refused:
        await admissions.admit(1)
    assert (refused.value.status, refused.value.code) == (429, "queue_full")
    assert refused.value.retry_after == 4  # 2 sessions needed (1 ahead + its own) x 4 s / 2
    held.release()
    (await waiting).release()
    assert router.live == 0


async def test_the_wait_bound_refuses_with_retry_after_and_leaves_no_waiter(router):
    admissions = Admissions(router, router.metrics, max_waiting=4, max_wait_s=0.2)
    held = await admissions.admit(2)
    with pytest.raises(APIError) as refused:
        await admissions.admit(1)
    assert (refused.value.status, refused.value.code) == (429, "queue_timeout")
    assert refused.value.retry_after >= 1
    assert not admissions.waiters and gauge(router, "specsplit_num_requests_waiting") == 0
    held.release()
    assert router.live == 0


@pytest.mark.parametrize("admitted_first", [False, True])
async def test_a_cancelled_waiter_leaves_the_queue_and_holds_nothing(router, admitted_first):
    """Cancelled while waiting, or just after its sessions were handed over: nothing leaks."""
    admissions = Admissions(router, router.metrics, max_waiting=4, max_wait_s=30)
    held = await admissions.admit(2)
    waiter = asyncio.create_task(admissions.admit(2))
    await settle(lambda: len(admissions.waiters) == 1)
    if admitted_first:
        held.release()  # hands the sessions to the waiter, which has not run since
        assert router.live == 2
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not admissions.waiters and gauge(router, "specsplit_num_requests_waiting") == 0
    held.release()
    assert router.live == 0 and admissions.running == 0
    (await admissions.admit(2)).release()


async def test_no_target_is_503_at_once_and_for_those_waiting(router):
    admissions = Admissions(router, router.metrics, max_waiting=4, max_wait_s=30)
    held = await admissions.admit(2)
    waiting = asyncio.create_task(admissions.admit(1))
    await settle(lambda: len(admissions.waiters) == 1)
    router.targets.workers["t0"].backend.stop()
    await router.targets.check_all()
    with pytest.raises(APIError) as now:
        await admissions.admit(1)
    with pytest.raises(APIError) as queued:
        await waiting
    assert now.value.status == queued.value.status == 503
    held.release()
    assert router.live == 0 and not admissions.waiters


async def test_draining_refuses_new_and_waiting_requests_while_the_live_ones_finish(router):
    admissions = Admissions(router, router.metrics, max_waiting=4, max_wait_s=30)
    held = await admissions.admit(2)
    waiting = asyncio.create_task(admissions.admit(1))
    await settle(lambda: len(admissions.waiters) == 1)
    router.draining = True
    admissions.wake()  # what Gateway.drain does
    with pytest.raises(APIError) as queued:
        await waiting
    with pytest.raises(APIError) as now:
        await admissions.admit(1)
    for refused in (queued.value, now.value):
        assert (refused.status, refused.code) == (503, "shutting_down") and refused.retry_after
    assert router.live == 2  # the live request keeps its sessions until it ends
    held.release()
    assert router.live == 0 and not admissions.waiters


# --- through the gateway ------------------------------------------------------------------

PROMPTS = ["one two three", "the cat sat on", "red blue green", "hello world , hello"]


def client_of(gateway) -> OpenAI:
    return OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)


def hold(client: OpenAI, target: SlowTarget):
    """A stream that has started and then holds its session until it is closed: the
    target's next verify stalls, so no end of sequence can end it early."""
    holder = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "one"}],
        max_tokens=200,
        temperature=0,
        stream=True,
    )
    next(iter(holder))
    target.stall_s = 60.0
    return holder


def stream_text(client: OpenAI, prompt: str) -> str:
    messages = [{"role": "user", "content": prompt}]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True
    )
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_capacity_2_with_4_concurrent_streams_all_succeed_the_last_after_waiting(tiny_dir):
    with live(tiny_dir, [slow_target(tiny_dir, "t0", 0.05)], max_sessions=2) as gateway:
        client = client_of(gateway)
        solo = [stream_text(client, p) for p in PROMPTS]
        texts: dict[int, str] = {}

        def run(i: int) -> None:
            texts[i] = stream_text(client, PROMPTS[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for thread in threads:
            thread.start()
        wait_until(lambda: len(gateway.gateway.admissions.waiters) == 2, what="2 waiting")
        for thread in threads:
            thread.join(60)
        assert [texts.get(i) for i in range(len(PROMPTS))] == solo
        assert gateway.gateway.router.live == 0


def test_a_full_queue_is_429_with_retry_after(tiny_dir):
    t0 = slow_target(tiny_dir, "t0", 0.05)
    with live(tiny_dir, [t0], max_sessions=1, max_waiting=1) as gateway:
        client = client_of(gateway)
        holder = hold(client, t0)
        queued = threading.Thread(target=stream_text, args=(client, "two"))
        queued.start()
        wait_until(lambda: len(gateway.gateway.admissions.waiters) == 1, what="one waiting")
        body = {"model": MODEL, "messages": [{"role": "user", "content": "three"}]}
        response = httpx.post(gateway.url + "/v1/chat/completions", json=body)
        assert response.status_code == 429
        assert int(response.headers["retry-after"]) >= 1
        assert response.json()["error"]["code"] == "queue_full"
        assert "specsplit_num_requests_waiting 1.0" in httpx.get(gateway.url + "/metrics").text
        holder.close()
        queued.join(30)
        wait_until(lambda: gateway.gateway.router.live == 0, what="all released")


def test_a_stream_that_waits_past_the_bound_is_an_http_429(tiny_dir):
    t0 = slow_target(tiny_dir, "t0", 0.05)
    with live(tiny_dir, [t0], max_sessions=1, max_queue_wait_s=0.3) as gateway:
        client = client_of(gateway)
        holder = hold(client, t0)
        with pytest.raises(openai.RateLimitError) as refused:
            stream_text(client, "two")
        assert refused.value.body["code"] == "queue_timeout"
        assert int(refused.value.response.headers["retry-after"]) >= 1
        holder.close()


def test_a_client_that_leaves_while_waiting_leaves_the_queue(tiny_dir):
    t0 = slow_target(tiny_dir, "t0", 0.05)
    with live(tiny_dir, [t0], max_sessions=1) as gateway:
        client = client_of(gateway)
        holder = hold(client, t0)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "two"}], "max_tokens": 4}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=0.5)
        admissions = gateway.gateway.admissions
        wait_until(lambda: not admissions.waiters, what="the waiter gone")
        holder.close()
        wait_until(lambda: gateway.gateway.router.live == 0, what="all released")
        assert stream_text(client, "three")
        assert admissions.running == 0


def test_a_stream_still_running_when_the_drain_times_out_ends_with_a_503_event(tiny_dir):
    t0 = slow_target(tiny_dir, "t0", 0.3)
    with live(tiny_dir, [t0]) as gateway:
        body = {"model": MODEL, "prompt": "one", "max_tokens": 200, "temperature": 0}
        solo = httpx.post(gateway.url + "/v1/completions", json=body, timeout=60).json()
        events = []
        with httpx.stream(
            "POST", gateway.url + "/v1/completions", json={**body, "stream": True}, timeout=60
        ) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            events.append(json.loads(next(lines)[6:]))
            drained = gateway.call(gateway.gateway.drain(0.2, asyncio.Event()))
            events += [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
        assert drained is False
        error = events[-1]["error"]
        assert (error["code"], error["type"]) == ("shutting_down", "service_unavailable")
        text = "".join(e["choices"][0]["text"] for e in events[:-1] if e.get("choices"))
        assert solo["choices"][0]["text"].startswith(text)  # what came is exact, only shorter
        assert gateway.gateway.router.live == 0
