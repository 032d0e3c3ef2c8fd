"""Per-request speculation control (`"speculation": {...}` in the body) through the OpenAI SDK."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI

from tests.gateway.helpers import MODEL, live, load_engine, model_draft
from workers.engine.sessions import SessionTable
from workers.loop.inprocess import LOCAL_NGRAM, InProcessTarget
from workers.speculation.acceptance import EXACT, AcceptanceRule
from workers.speculation.tree import depths
from workers.target.runner import TargetRunner

REPEAT = [{"role": "user", "content": "one two three one two three one two three one two"}]


class RecordingTarget(InProcessTarget):
    """A target that keeps every VerifyCall it answers."""

    def __init__(self, *args):
        super().__init__(*args)
        self.calls = []

    async def verify(self, call):
        self.calls.append(call)
        return await super().verify(call)


def recording_target(path) -> RecordingTarget:
    return RecordingTarget("t0", TargetRunner(load_engine(path), SessionTable(4)))


@pytest.fixture(scope="module")
def recorded(tiny_dir):
    """A gateway that allows lossy acceptance (n-gram draft), and its recording target."""
    backend = recording_target(tiny_dir)
    with live(tiny_dir, [backend], allow_lossy=True, adaptive_tree=False) as gateway:
        yield gateway, backend


def ask(gateway, speculation: dict | None = None, stream: bool = False, **kw) -> httpx.Response:
    body = {"model": MODEL, "messages": REPEAT, "max_tokens": 24, "temperature": 0, **kw}
    if speculation is not None:
        body["speculation"] = speculation
    return httpx.post(gateway.url + "/v1/chat/completions", json={**body, "stream": stream})


def sdk(gateway) -> OpenAI:
    return OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)


def chat(client, speculation: dict | None = None):
    extra = {"speculation_stats": True}
    if speculation is not None:
        extra["speculation"] = speculation
    return client.chat.completions.create(
        model=MODEL, messages=REPEAT, max_tokens=24, temperature=0, extra_body=extra
    )


def test_off_drafts_nothing_and_says_so(recorded):
    gateway, backend = recorded
    client = sdk(gateway)
    auto = chat(client)
    assert auto.model_extra["speculation_stats"]["draft_tokens"] > 0
    backend.calls.clear()
    off = chat(client, {"method": "off"})
    stats = off.model_extra["speculation_stats"]
    assert stats["draft_tokens"] == 0 and stats["method"] == "off"
    assert all(len(c.tree) == 0 for c in backend.calls)
    assert off.choices[0].message.content == auto.choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL,
        messages=REPEAT,
        max_tokens=24,
        temperature=0,
        stream=True,
        extra_body={"speculation": {"method": "off"}, "speculation_stats": True},
    )
    chunks = list(stream)
    assert chunks[-1].model_extra["speculation_stats"]["draft_tokens"] == 0


def test_max_depth_and_max_nodes_cap_every_tree(recorded):
    gateway, backend = recorded
    client = sdk(gateway)
    full = chat(client)
    backend.calls.clear()
    capped = chat(client, {"max_depth": 2, "max_nodes": 3})
    stats = capped.model_extra["speculation_stats"]
    assert (stats["method"], stats["max_depth"], stats["max_nodes"]) == ("ngram", 2, 3)
    trees = [c.tree for c in backend.calls if len(c.tree)]
    assert trees and stats["draft_tokens"] > 0
    assert max(len(t) for t in trees) <= 3
    assert max(int(depths(t.parents).max()) for t in trees) <= 2
    assert capped.choices[0].message.content == full.choices[0].message.content
    depth_zero = chat(client, {"max_depth": 0})
    assert depth_zero.model_extra["speculation_stats"]["draft_tokens"] == 0


def test_exact_is_the_default_even_when_lossy_is_allowed(recorded):
    gateway, backend = recorded
    backend.calls.clear()
    reply = ask(gateway)
    assert reply.status_code == 200
    assert reply.headers["x-specsplit-acceptance"] == "exact"
    assert "speculation_stats" not in reply.json()
    assert backend.calls and all(c.acceptance == EXACT for c in backend.calls)


@pytest.mark.parametrize("stream", [False, True])
def test_a_lossy_response_is_marked(recorded, stream):
    gateway, backend = recorded
    backend.calls.clear()
    reply = ask(gateway, {"acceptance": "threshold", "threshold": 0.2}, stream=stream)
    assert reply.status_code == 200
    assert reply.headers["x-specsplit-acceptance"] == "threshold; t=0.2"
    if stream:
        events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        stats = httpx.Response(200, content=events[-2]).json()["speculation_stats"]
    else:
        stats = reply.json()["speculation_stats"]  # not asked for: a lossy response says so
    assert stats["acceptance"] == "threshold" and stats["lossless"] is False
    rule = AcceptanceRule("threshold", threshold=0.2)
    assert backend.calls and all(c.acceptance == rule for c in backend.calls)


def test_typical_acceptance_runs_with_sampling(recorded):
    gateway, _ = recorded
    spec = {"acceptance": "typical", "epsilon": 0.2, "delta": 0.4}
    reply = ask(gateway, spec, temperature=0.8, seed=3)
    assert reply.status_code == 200
    assert reply.headers["x-specsplit-acceptance"] == "typical; epsilon=0.2; delta=0.4"


def error_of(reply: httpx.Response) -> dict:
    assert reply.status_code == 400, reply.text
    return reply.json()["error"]


@pytest.mark.parametrize(
    "speculation, param",
    [
        ({"method": "draft"}, "speculation.method"),  # this deployment drafts with n-grams
        ({"method": "eagle"}, "speculation.method"),
        ({"max_depth": -1}, "speculation.max_depth"),
        ({"max_nodes": "4"}, "speculation.max_nodes"),
        ({"acceptance": "threshold", "threshold": 0}, "speculation.threshold"),
        ({"acceptance": "exact", "threshold": 0.3}, "speculation.threshold"),
        ({"acceptance": "threshold", "delta": 0.3}, "speculation.delta"),
        ({"speculate": True}, "speculation.speculate"),
    ],
)
def test_bad_speculation_fields_are_400s(recorded, speculation, param):
    gateway, _ = recorded
    assert error_of(ask(gateway, speculation))["param"] == param


def test_lossy_is_refused_unless_the_server_allows_it(tiny_dir, tiny_draft_dir):
    backends = [recording_target(tiny_dir), model_draft(tiny_draft_dir)]
    with live(tiny_dir, backends) as gateway:
        for rule in ("threshold", "typical"):
            error = error_of(ask(gateway, {"acceptance": rule}))
            assert (error["param"], error["code"]) == (
                "speculation.acceptance",
                "lossy_acceptance_forbidden",
            )
        with pytest.raises(openai.BadRequestError):
            chat(sdk(gateway), {"acceptance": "typical"})
        auto = chat(sdk(gateway))
        reply = chat(sdk(gateway), {"method": "draft", "max_nodes": 2})
        stats = reply.model_extra["speculation_stats"]
        assert (stats["method"], stats["max_nodes"], stats["lossless"]) == ("draft", 2, True)
        assert auto.model_extra["speculation_stats"]["method"] == "draft"
        ngram = chat(sdk(gateway), {"method": "ngram"})  # the gateway's own n-gram drafter
        stats = ngram.model_extra["speculation_stats"]
        assert stats["method"] == "ngram" and stats["accepted_tokens"] > 0
        texts = {r.choices[0].message.content for r in (auto, reply, ngram)}
        assert len(texts) == 1
        assert all(c.acceptance == EXACT for c in backends[0].calls)


def test_without_a_draft_auto_is_off_and_draft_is_a_400(tiny_dir):
    with live(tiny_dir, [recording_target(tiny_dir)], local_draft="none") as gateway:
        error = error_of(ask(gateway, {"method": "draft"}))
        assert (error["param"], error["code"]) == (
            "speculation.method",
            "speculation_method_unavailable",
        )
        stats = chat(sdk(gateway)).model_extra["speculation_stats"]
        assert stats["method"] == "off" and stats["draft_tokens"] == 0
        assert (
            chat(sdk(gateway), {"method": "ngram"}).model_extra["speculation_stats"]["draft_tokens"]
            > 0
        )


def test_the_gateways_own_ngram_draft_looks_up_the_loops_own_index(tiny_dir):
    """The default draft's trees come from the index of the history each loop keeps for its
    rounds' match lengths: the in-process drafter, which would hold and index the history
    a second time, is never asked, and the text is the target's."""
    with live(tiny_dir, [recording_target(tiny_dir)]) as gateway:
        drafter = gateway.gateway.router.drafts.workers[LOCAL_NGRAM].backend.drafter
        asked = []
        drafter.propose = asked.append
        auto = chat(sdk(gateway))
        stats = auto.model_extra["speculation_stats"]
        assert stats["method"] == "ngram" and stats["draft_tokens"] > 0
        assert stats["degraded_rounds"] == 0 and asked == []
        off = chat(sdk(gateway), {"method": "off"})
        assert auto.choices[0].message.content == off.choices[0].message.content
