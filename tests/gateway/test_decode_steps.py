"""Decode steps through the gateway (`--decode-steps`): rounds without a draft have the
target decode several tokens in a row, and the client gets the same text, greedy or
seeded sampling, as with a token a round; the stream's provenance counts the forwards.
With `--decode-lookup` each greedy step also verifies the target worker's own prompt
lookup, and the text is still the target's."""

import httpx
import pytest
from openai import OpenAI

from gateway.app import create_app
from tests.gateway.helpers import (
    MODEL,
    LiveGateway,
    live,
    load_engine,
    sample,
    settings,
    slow_target,
    target,
    wait_until,
)
from tests.gateway.test_hybrid import grpc_workers
from tests.gateway.test_provenance import ASK, STATS

CHAT = [{"role": "user", "content": "Tell me about the sea and the ships on it."}]


def streamed(client, messages: list[dict], max_tokens: int, extra: dict) -> list:
    """A greedy stream's chunks, with provenance and usage."""
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options=ASK["stream_options"],
        extra_body=extra,
    )
    return list(chunks)


def text_of(chunks) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def rounds_of(chunks) -> list[dict]:
    """The rounds the chunks' provenance reported."""
    return [r for c in chunks for r in (c.model_extra.get("specsplit") or {}).get("rounds", [])]


def replies(tiny_dir, steps: int) -> tuple[list[str], list[dict]]:
    """Greedy and seeded sampled texts (speculation off, then the deployment's draft: the
    gateway's own n-gram), and the rounds of a greedy stream with speculation off."""
    with live(tiny_dir, [target(tiny_dir)], decode_steps=steps) as gateway:
        client = OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
        texts = []
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}):
            for method in ("off", "auto"):
                reply = client.chat.completions.create(
                    model=MODEL,
                    messages=CHAT,
                    max_tokens=40,
                    extra_body={"speculation": {"method": method}},
                    **sampling,
                )
                texts.append(reply.choices[0].message.content)
        chunks = streamed(client, CHAT, 40, {**STATS, "speculation": {"method": "off"}})
    rounds = rounds_of(chunks)
    stats = chunks[-1].model_extra["speculation_stats"]
    assert sum(r["forwards"] for r in rounds) == stats["verify_steps"]
    assert stats["rounds"] == len(rounds)  # a round trip each, however many steps it took
    assert sum(r["tokens"] for r in rounds) == chunks[-1].usage.completion_tokens
    return texts, rounds


def test_decode_steps_give_the_text_of_a_token_a_round(tiny_dir):
    stepped, rounds = replies(tiny_dir, 4)
    single, plain_rounds = replies(tiny_dir, 1)
    assert stepped == single
    assert {r["forwards"] for r in plain_rounds} == {1}
    assert rounds[0]["forwards"] == 1  # the first token comes after the prompt's forward
    assert max(r["forwards"] for r in rounds) == 4
    assert all(r["tokens"] == r["forwards"] for r in rounds)  # no draft: a token a forward


def test_a_session_whose_drafts_are_accepted_looks_up_every_token(tiny_dir):
    """With the gateway's n-gram draft, a round decodes several tokens only once the
    session's drafts have gone unaccepted for twice the steps' tokens (8 here): text that
    copies keeps a lookup every token."""
    copy = "one two three four five six seven eight nine ten " * 3
    messages = [{"role": "user", "content": copy}]
    with live(tiny_dir, [target(tiny_dir)], decode_steps=4, suffix_cache_tokens=0) as gateway:
        client = OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
        rounds = rounds_of(streamed(client, messages, 64, {}))
    unaccepted = 0
    for r in rounds:
        if r["forwards"] > 1:
            assert unaccepted >= 8 and not r["tree_nodes"]
        unaccepted = 0 if r["accepted"] else unaccepted + r["tokens"]
    assert any(r["accepted"] for r in rounds)


def test_a_session_steps_at_once_where_no_draft_can_pay(tiny_dir):
    """On a target where every token fed costs 40 ms (compute-bound), once the cost is
    measured no draft pays: the session decodes several tokens a round without waiting for
    8 unaccepted ones, and its text is the target's own. (At 20 ms a token, one of the
    first rounds taking 60 ms longer than its tokens, a pause of the test's process,
    tipped the young fit towards drafts in about a third of runs.)"""
    copy = "one two three four five six seven eight nine ten " * 3
    messages = [{"role": "user", "content": copy}]
    slow = slow_target(tiny_dir, "t0", 0.0, token_delay=0.040)
    with live(tiny_dir, [slow], decode_steps=4, suffix_cache_tokens=0) as gateway:
        client = OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
        chunks = streamed(client, messages, 48, {})
        off = streamed(client, messages, 48, {"speculation": {"method": "off"}})
    assert text_of(chunks) == text_of(off)
    rounds = rounds_of(chunks)
    stepped = [i for i, r in enumerate(rounds) if r["forwards"] > 1]
    assert stepped and sum(r["tokens"] for r in rounds[: stepped[0]]) < 8


def test_a_token_a_round_stops_where_it_brings_less_than_steps(tiny_dir):
    """Over a real gRPC target (its rounds teach the time that steps save), a session's
    rounds of a token at a time that bring fewer tokens than steps would have in their
    time (the tiny model rarely takes a copied token) teach every session's pace
    (`gateway.adaptive.Pace`), and the next request steps before 8 tokens have gone
    unaccepted, with speculation off's text. (Which of the two rules stepped, the pace or
    no draft paying, the unit test in test_adaptive.py tells apart.)"""
    copy = [{"role": "user", "content": "one two three four five six seven eight nine ten " * 3}]
    with grpc_workers({"target": load_engine(tiny_dir)}) as addresses:
        config = settings(
            tiny_dir, [addresses["target"]], insecure=True, decode_steps=4, suffix_cache_tokens=0
        )
        with LiveGateway(create_app(config)) as gateway:
            client = OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
            streamed(client, copy, 48, {})
            pace = gateway.gateway.generator.recent.pace
            assert 0 < pace.tokens < pace.par  # measured, and short of what steps bring
            chunks = streamed(client, copy, 48, {})
            off = streamed(client, copy, 48, {"speculation": {"method": "off"}})
    assert text_of(chunks) == text_of(off)
    rounds, unaccepted = rounds_of(chunks), 0
    for r in rounds[1:]:
        if r["forwards"] > 1:
            break
        unaccepted = 0 if r["accepted"] else unaccepted + r["tokens"]
    assert unaccepted < 8


def test_the_gateway_learns_what_a_round_spends_besides_the_targets_forward(tiny_dir):
    """Over a real gRPC target, the one-forward rounds teach the target's cost what a round
    spends outside the call's work and besides the forward (gateway.adaptive.RoundCost),
    what a round of decode steps pays once: adaptive trees weigh no draft with it. The
    gateway exports the cost as its trees read it, by part. One drafting epoch
    (gateway/epochs.py) holds both requests: a plain epoch, which a slow machine could
    reach after the first 4 s, takes decode steps in every round."""
    with grpc_workers({"target": load_engine(tiny_dir)}) as addresses:
        address = addresses["target"]
        config = settings(
            tiny_dir,
            [address],
            insecure=True,
            decode_steps=4,
            health_interval_s=0.1,
            adaptive_epoch_s=3600.0,
        )
        with LiveGateway(create_app(config)) as gateway:
            client = OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
            for _ in range(2):
                rounds = rounds_of(streamed(client, CHAT, 40, {}))
            cost = gateway.gateway.router.targets.workers[address].cost
            series = f'specsplit_target_round_cost_seconds{{address="{address}",part="%s"}}'
            parts = ("fixed", "token", "outside", "beside")

            def exported() -> dict[str, float | None]:
                text = httpx.get(gateway.url + "/metrics").text
                return {part: sample(text, series % part) for part in parts}

            line = cost.line(gateway.gateway.router.targets.adaptive)  # no traffic now
            seconds = (line.fixed_s, line.token_s, line.outside_s, line.beside_s)
            expected = pytest.approx(dict(zip(parts, seconds, strict=True)))
            wait_until(lambda: exported() == expected, what="the round cost exported")
    assert any(r["forwards"] == 1 for r in rounds[1:])  # one-forward rounds past the first
    weight, outside, beside = cost.gaps
    assert weight > 0 and 0 < outside <= beside
    assert (line.outside_s, line.beside_s) == (outside / weight, beside / weight)


def test_decode_steps_own_lookups_give_speculation_offs_text(tiny_dir):
    """On a target where no draft of the gateway's pays (60 ms a token fed) and whose
    forwards have 8 cheap rows, a greedy session's steps verify up to 3 tokens the target
    looks up itself: the text is speculation off's, the provenance names each accepted
    one, and the stats count them as drafts; a seeded sampled request, and speculation
    off, take none (an unseeded one may: tests/decoding/test_sampling_lossless.py)."""
    copy = "one two three four five six seven eight nine ten " * 3
    messages = [{"role": "user", "content": copy}]
    slow = slow_target(tiny_dir, "t0", 0.0, token_delay=0.060, lookup_rows=8)
    with live(tiny_dir, [slow], decode_steps=4, decode_lookup=3, suffix_cache_tokens=0) as gateway:
        client = OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
        chunks = streamed(client, messages, 64, STATS)
        off = streamed(client, messages, 64, {**STATS, "speculation": {"method": "off"}})
        sampled = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=32, temperature=1.0, seed=5,
            stream=True, stream_options=ASK["stream_options"],
        )  # fmt: skip
        sampled_rounds = rounds_of(list(sampled))
    assert text_of(chunks) == text_of(off)
    rounds, stats = rounds_of(chunks), chunks[-1].model_extra["speculation_stats"]
    assert sum(r["lookup_accepted"] for r in rounds) > 0
    assert stats["draft_tokens"] == sum(r["tree_nodes"] + r["lookup_nodes"] for r in rounds)
    assert stats["accepted_tokens"] == sum(r["accepted"] + r["lookup_accepted"] for r in rounds)
    origins = [t for c in chunks for t in (c.model_extra.get("specsplit") or {}).get("tokens", [])]
    drafted = {t["i"] for t in origins if t["source"] == "draft"}
    assert len(drafted) == stats["accepted_tokens"]
    assert not any(r["lookup_nodes"] for r in rounds_of(off) + sampled_rounds)
