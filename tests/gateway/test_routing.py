"""Routing and failure handling: failover, lost sessions, degraded rounds, 503/429, disconnects."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from openai import OpenAI
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.adaptive import AdaptiveConfig
from gateway.metrics import Metrics
from gateway.pool import Pool, resolve_address
from tests.gateway.helpers import (
    MODEL,
    WORDS,
    live,
    model_draft,
    slow_target,
    target,
    wait_until,
)

CHAT = [{"role": "user", "content": "one two three four five"}]


def client_of(gateway) -> OpenAI:
    return OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)


def stream_text(client, stop_after: int | None = None, on_chunk=None, **kw) -> str:
    text = ""
    for i, chunk in enumerate(client.chat.completions.create(model=MODEL, stream=True, **kw)):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if on_chunk is not None:
            on_chunk(i)
    return text


def busy_target(gateway):
    return next(w for w in gateway.gateway.router.targets.workers.values() if w.load > 0)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=7)])
def test_target_dies_mid_stream_and_the_stream_goes_on(tiny_dir, sampling):
    backends = [slow_target(tiny_dir, "t0", 0.02), slow_target(tiny_dir, "t1", 0.02)]
    kw = dict(messages=CHAT, max_tokens=40, extra_body={"top_k": 0}, **sampling)
    # no suffix cache: it would draft the second run whole from the first one's output, so
    # the kill at the 4th chunk would find nothing running
    with live(tiny_dir, backends, suffix_cache_tokens=0) as gateway:
        client = client_of(gateway)
        clean = stream_text(client, **kw)
        killed = []

        def kill_after_a_few(i: int) -> None:
            if i == 4 and not killed:
                worker = busy_target(gateway)
                worker.backend.stop()
                killed.append(worker.address)

        faulted = stream_text(client, on_chunk=kill_after_a_few, **kw)
        assert killed
        assert faulted == clean
        metrics = httpx.get(gateway.url + "/metrics").text
        assert 'specsplit_failovers_total{role="target"} 1.0' in metrics


def test_lost_session_is_resent_to_the_same_worker(tiny_dir):
    backend = slow_target(tiny_dir, "t0", 0.02)
    # no suffix cache: it would draft the repeat whole from the first run's output, so the
    # eviction at the 3rd chunk could come after the last round
    with live(tiny_dir, [backend], suffix_cache_tokens=0) as gateway:
        client = client_of(gateway)
        kw = dict(
            messages=CHAT, max_tokens=30, temperature=0, extra_body={"speculation_stats": True}
        )
        clean = client.chat.completions.create(model=MODEL, **kw).choices[0].message.content
        evicted = []

        def evict(i: int) -> None:
            if i == 3:
                table = backend.runner.table
                evicted.extend(list(table.sessions))
                for sid in list(table.sessions):
                    table.end(sid)

        assert (
            stream_text(client, on_chunk=evict, messages=CHAT, max_tokens=30, temperature=0)
            == clean
        )
        assert evicted
        metrics = httpx.get(gateway.url + "/metrics").text
        assert 'specsplit_history_resends_total{role="target"} 1.0' in metrics


def test_without_a_healthy_draft_the_target_decodes_alone(tiny_dir, tiny_draft_dir):
    draft = model_draft(tiny_draft_dir)
    # fixed trees: every round wants a draft (an adaptive round may measure that none pays);
    # a token a round (without a draft, a round would have the target decode several)
    with live(tiny_dir, [target(tiny_dir), draft], adaptive_tree=False, decode_steps=1) as gateway:
        client = client_of(gateway)
        kw = dict(model=MODEL, messages=CHAT, max_tokens=20, temperature=0)
        before = client.chat.completions.create(**kw).choices[0].message.content
        draft.stop()
        reply = client.chat.completions.create(extra_body={"speculation_stats": True}, **kw)
        assert reply.choices[0].message.content == before
        stats = reply.model_extra["speculation_stats"]
        assert stats["draft_tokens"] == 0 and stats["verify_steps"] == 20
        assert stats["degraded_rounds"] == 19  # the last round wants no draft (1 token left)
        wait_until(lambda: httpx.get(gateway.url + "/health").status_code == 503, what="health 503")
        assert "specsplit_degraded_rounds_total" in httpx.get(gateway.url + "/metrics").text


def test_no_healthy_target_is_503_with_retry_after(tiny_dir):
    backend = target(tiny_dir)
    with live(tiny_dir, [backend]) as gateway:
        backend.stop()
        wait_until(lambda: httpx.get(gateway.url + "/health").status_code == 503, what="health 503")
        response = httpx.post(
            gateway.url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT}
        )
        assert response.status_code == 503
        assert int(response.headers["retry-after"]) >= 1
        assert response.json()["error"]["code"] == "no_healthy_target"


def test_too_many_sessions_is_429_with_retry_after(tiny_dir):
    """Without a queue (max_waiting 0) a request over capacity is refused at once."""
    t0 = slow_target(tiny_dir, "t0", 0.05)
    with live(tiny_dir, [t0], max_sessions=1, max_waiting=0) as gateway:
        client = client_of(gateway)
        stream = client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=30, temperature=0, stream=True
        )
        next(iter(stream))
        response = httpx.post(
            gateway.url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT}
        )
        assert response.status_code == 429
        assert response.headers["retry-after"]
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt="the", max_tokens=2)
        stream.close()


def test_disconnect_ends_the_sessions_on_both_workers(tiny_dir, tiny_draft_dir):
    t0 = slow_target(tiny_dir, "t0", 0.05)
    d0 = model_draft(tiny_draft_dir)
    with live(tiny_dir, [t0, d0]) as gateway:
        client = client_of(gateway)
        stream = client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=60, temperature=0, stream=True
        )
        chunks = iter(stream)
        for _ in range(3):
            next(chunks)
        assert len(t0.runner.table) == 1 and len(d0.drafter.table) == 1
        stream.close()
        wait_until(
            lambda: len(t0.runner.table) == 0 and len(d0.drafter.table) == 0,
            what="sessions ended on both workers",
        )
        wait_until(lambda: gateway.gateway.router.live == 0, what="no live sessions")
        assert "specsplit_live_sessions 0.0" in httpx.get(gateway.url + "/metrics").text


def test_non_streaming_disconnect_cancels_generation(tiny_dir):
    t0 = slow_target(tiny_dir, "t0", 0.05)
    with live(tiny_dir, [t0]) as gateway:
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 200, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=0.5)
        wait_until(lambda: gateway.gateway.router.live == 0, what="generation cancelled")
        wait_until(lambda: len(t0.runner.table) == 0, what="session ended")


def conversation_turn(client, messages, name: str, max_tokens: int):
    """One greedy turn of the conversation `name`: the reply and its prefix-cache hit."""
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        extra_headers={"X-Session-ID": name},
        extra_body={"speculation_stats": True},
    )
    return reply, reply.model_extra["speculation_stats"]["prefix_hit_tokens"]


def test_conversation_affinity_reuses_the_cached_prefix(tiny_dir):
    backends = [target(tiny_dir, "t0"), target(tiny_dir, "t1")]
    with live(tiny_dir, backends) as gateway:
        client = client_of(gateway)
        messages = list(CHAT)
        hits, holders = [], []
        for turn in range(3):
            reply, hit = conversation_turn(client, messages, "conversation-1", 6)
            hits.append(hit)
            holders.append([b.address for b in backends if len(b.runner.table)])
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": f"turn {turn}"},
            ]
        assert hits[0] == 0 and hits[1] > 0 and hits[2] > hits[1]
        assert holders[0] == holders[1] == holders[2] and len(holders[0]) == 1
        assert "specsplit_prefix_cache_hits_total 2.0" in httpx.get(gateway.url + "/metrics").text


def test_sessions_go_where_their_prompt_prefix_went(tiny_dir):
    """Without a conversation key, a conversation's next turn and another request opening with
    the same long system prompt go to the target that got that prefix, and find it cached
    there; a prompt sharing less than half of its blocks with those goes least loaded."""
    backends = [target(tiny_dir, "t0"), target(tiny_dir, "t1")]
    system = {"role": "system", "content": " ".join(WORDS[i % 30] for i in range(40))}
    with live(tiny_dir, backends) as gateway:
        client = client_of(gateway)
        workers = gateway.gateway.router.targets.workers.values()

        def turn(messages) -> tuple[str, int, list[int]]:
            """The reply, its prefix hit, and how many sessions each target has been given."""
            reply = client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=6,
                temperature=0,
                extra_body={"speculation_stats": True},
            )
            hit = reply.model_extra["speculation_stats"]["prefix_hit_tokens"]
            return reply.choices[0].message.content, hit, sorted(w.picks for w in workers)

        messages = [system, {"role": "user", "content": "one two"}]
        text, hit, picks = turn(messages)
        assert hit == 0 and picks == [0, 1]
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "three"}]
        _, hit, picks = turn(messages)
        assert hit >= 48 and picks == [0, 2]
        _, hit, picks = turn([system, {"role": "user", "content": "red blue green"}])
        assert hit >= 32 and picks == [0, 3]
        _, hit, picks = turn([{"role": "user", "content": " ".join(WORDS[:25])}])
        assert hit == 0 and picks == [1, 3]
        metrics = httpx.get(gateway.url + "/metrics").text
        assert 'specsplit_prefix_routed_sessions_total{role="target"} 2.0' in metrics


def test_prefix_routing_yields_to_load(tiny_dir):
    """Concurrent sessions with one prompt go to the target holding it only while it has at most
    `prefix_routing_slack` more live sessions than the other: with a slack of 2, four go
    t0, t0, t0, then t1 (t0 has three more); least loaded alone would give two each."""
    backends = [slow_target(tiny_dir, "t0", 0.2), slow_target(tiny_dir, "t1", 0.2)]
    with live(tiny_dir, backends, prefix_routing_slack=2) as gateway:
        client = client_of(gateway)
        prompt = [{"role": "user", "content": " ".join(WORDS[i % 30] for i in range(40))}]
        workers = gateway.gateway.router.targets.workers.values()
        streams = []
        for n in range(1, 5):
            streams.append(
                client.chat.completions.create(
                    model=MODEL, messages=prompt, max_tokens=200, temperature=0, stream=True
                )
            )
            next(iter(streams[-1]))  # the role chunk: the choice binds its workers right after
            wait_until(lambda n=n: sum(w.load for w in workers) == n, what=f"{n} streams bound")
        assert sorted(w.load for w in workers) == [1, 3]
        for stream in streams:
            stream.close()


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=7)])
def test_a_shared_system_prompt_is_prefilled_once(tiny_dir, sampling):
    """Two conversations open with the same 40-word system prompt: the second finds its
    blocks cached on the worker, and both replies equal those of a worker without prefix
    caching."""
    system = {"role": "system", "content": " ".join(WORDS[i % 30] for i in range(40))}
    replies, hits, metrics = {}, {}, {}
    for caching in (True, False):
        with live(tiny_dir, [target(tiny_dir, prefix_caching=caching)]) as gateway:
            turns = [
                client_of(gateway).chat.completions.create(
                    model=MODEL,
                    messages=[system, {"role": "user", "content": question}],
                    max_tokens=8,
                    extra_body={"speculation_stats": True},
                    **sampling,
                )
                for question in ("one two", "red blue green")
            ]
            metrics[caching] = httpx.get(gateway.url + "/metrics").text
        replies[caching] = [t.choices[0].message.content for t in turns]
        hits[caching] = [t.model_extra["speculation_stats"]["prefix_hit_tokens"] for t in turns]
    assert hits[True][0] == 0 and hits[True][1] >= 32 and hits[False] == [0, 0]
    assert replies[True] == replies[False]
    assert "specsplit_prefix_cache_hits_total 1.0" in metrics[True]
    assert "specsplit_prefix_cache_hits_total 0.0" in metrics[False]


def test_cached_prefixes_are_shared_by_salt_and_by_scope(tiny_dir):
    """Requests share cached prompt blocks only with the same cache_salt; with the tenant
    scope, only with requests of the same API key (and salt)."""
    system = {"role": "system", "content": " ".join(WORDS[i % 30] for i in range(40))}

    def hit(gateway, key: str, **body) -> int:
        client = OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[system, {"role": "user", "content": "one two"}],
            max_tokens=2,
            temperature=0,
            extra_body={"speculation_stats": True, **body},
        )
        return reply.model_extra["speculation_stats"]["prefix_hit_tokens"]

    with live(tiny_dir, [target(tiny_dir)]) as gateway:  # the global scope
        assert hit(gateway, "a", cache_salt="s1") == 0
        assert hit(gateway, "b", cache_salt="s2") == 0
        assert hit(gateway, "b", cache_salt="s1") >= 32  # another key, the same salt
        assert hit(gateway, "a") == 0  # unsalted requests share only among themselves
        assert hit(gateway, "b") >= 32
    with live(tiny_dir, [target(tiny_dir)], prefix_cache_scope="tenant") as gateway:
        assert hit(gateway, "a") == 0
        assert hit(gateway, "b") == 0
        assert hit(gateway, "a") >= 32
        assert hit(gateway, "a", cache_salt="s1") == 0
        assert hit(gateway, "a", cache_salt="s1") >= 32


def test_a_conversation_id_is_scoped_to_its_api_key(tiny_dir):
    # another key sending the same X-Session-ID reuses none of the first key's worker sessions
    with live(tiny_dir, [target(tiny_dir, "t0")]) as gateway:

        def prefix_hit(key: str) -> int:
            client = OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)
            return conversation_turn(client, CHAT, "shared-name", 4)[1]

        assert prefix_hit("key-a") == 0
        assert prefix_hit("key-b") == 0
        assert prefix_hit("key-a") > 0


def test_least_loaded_target_first(tiny_dir):
    backends = [slow_target(tiny_dir, "t0", 0.2), slow_target(tiny_dir, "t1", 0.2)]
    with live(tiny_dir, backends) as gateway:
        client = client_of(gateway)
        streams = [
            client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=200, temperature=0, stream=True
            )
            for _ in range(2)
        ]
        for stream in streams:
            next(iter(stream))  # the role chunk: the choice binds its workers right after
        workers = gateway.gateway.router.targets.workers.values()
        wait_until(lambda: sum(w.load for w in workers) == 2, what="both streams bound")
        assert sorted(w.load for w in workers) == [1, 1]
        for stream in streams:
            stream.close()


class FakeBackend:
    role = "target"

    def __init__(self, address: str):
        self.address = address

    async def health(self) -> bool:
        return True

    async def info(self):
        return None

    async def close(self) -> None:
        pass


async def test_dns_names_are_re_resolved():
    answers = {"targets.svc:50061": ["10.0.0.1:50061", "10.0.0.2:50061"]}

    async def resolver(address: str) -> list[str]:
        return answers[address]

    metrics, config = Metrics(), AdaptiveConfig()
    pool = Pool(
        "target",
        ["targets.svc:50061"],
        lambda r, a: FakeBackend(a),
        metrics,
        resolver=resolver,
        adaptive=config,
    )
    await pool.refresh()
    for worker in pool.workers.values():  # measured targets: their round cost is exported
        worker.cost.observe(8, 0.02, config)
    await pool.check_all()
    assert sorted(pool.workers) == ["10.0.0.1:50061", "10.0.0.2:50061"]
    assert all(w.serving for w in pool.workers.values())

    def costs() -> set[str]:
        text = generate_latest(metrics.registry).decode()
        return {
            s.labels["address"]
            for f in text_string_to_metric_families(text)
            if f.name == "specsplit_target_round_cost_seconds"
            for s in f.samples
        }

    assert costs() == {"10.0.0.1:50061", "10.0.0.2:50061"}
    answers["targets.svc:50061"] = ["10.0.0.2:50061", "10.0.0.3:50061"]  # a pod replaced
    await pool.refresh()
    assert sorted(pool.workers) == ["10.0.0.2:50061", "10.0.0.3:50061"]
    assert costs() == {"10.0.0.2:50061"}  # the pod gone, and its cost; the new one unmeasured
    await pool.close()


async def test_resolve_address():
    assert await resolve_address("localhost:7") == ["127.0.0.1:7"]
    assert await resolve_address("10.1.2.3:7") == ["10.1.2.3:7"]
    assert await resolve_address("[::1]:7") == ["[::1]:7"]
    assert await resolve_address("t0") == ["t0"]
    with pytest.raises(OSError):
        await resolve_address("no-such-host.invalid:7")
    assert asyncio.get_running_loop()


def test_failure_mid_stream_ends_with_an_error_event(tiny_dir):
    backend = slow_target(tiny_dir, "t0", 0.02)
    with live(tiny_dir, [backend]) as gateway:
        url = gateway.url + "/v1/chat/completions"
        body = {
            "model": MODEL,
            "messages": CHAT,
            "max_tokens": 40,
            "temperature": 0,
            "stream": True,
        }
        events = []
        with httpx.stream("POST", url, json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    if len(events) == 3:
                        backend.stop()
        last = json.loads(events[-1])
        assert set(last) == {"error"}
        assert last["error"]["code"] == "no_healthy_target"
        assert "[DONE]" not in events
        backend.alive = True  # back up: now the same through the SDK, which raises it
        wait_until(lambda: httpx.get(gateway.url + "/health").status_code == 200, what="health")
        stream = client_of(gateway).chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=40, temperature=0, stream=True
        )
        with pytest.raises(openai.APIError) as info:
            for i, _ in enumerate(stream):
                if i == 2:
                    backend.stop()
        assert info.value.body["code"] == "no_healthy_target"
