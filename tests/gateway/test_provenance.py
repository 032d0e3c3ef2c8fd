"""The stream's opt-in provenance (`specsplit` on each chunk), through the real openai client."""

from __future__ import annotations

import itertools

import httpx
import pytest
import torch
from openai import OpenAI

from gateway.provenance import Provenance
from gateway.text import TextStream
from tests.gateway.helpers import MODEL, live, model_draft, target
from tests.gateway.test_text import ids
from workers.loop.state import LoopState, Plan, Round
from workers.protocol import VerifyOutcome
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree

CHAT = [{"role": "user", "content": "one two three four one two three"}]
ASK = {"stream_options": {"include_provenance": True, "include_usage": True}}
STATS = {"speculation_stats": True}


# Fixed trees, no suffix cache, a token a round: greedy rounds, and so the chunks, are then
# the same in every run (adaptive trees follow the acceptance of every earlier request, the
# suffix cache drafts from earlier outputs, and a round of decode steps ends after the
# worker's forward whose count is a multiple of the steps: workers/target/runner.py).
FIXED = dict(adaptive_tree=False, suffix_cache_tokens=0, decode_steps=1)


@pytest.fixture(scope="module")
def model_client(tiny_dir, tiny_draft_dir):
    """A target and a draft worker with a model that the target often agrees with."""
    workers = [target(tiny_dir), model_draft(tiny_draft_dir)]
    with live(tiny_dir, workers, **FIXED) as gateway:
        yield OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def ngram_client(tiny_dir):
    with live(tiny_dir, [target(tiny_dir)], **FIXED) as gateway:
        yield OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)


def texts(chunks) -> dict[int, list]:
    """Each choice's chunk texts, in order (choices interleave as their rounds complete)."""
    out: dict[int, list] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            out.setdefault(choice.index, []).append(text_of(chunk))
    return out


def text_of(chunk) -> str | None:
    if not chunk.choices:
        return None
    choice = chunk.choices[0]
    return choice.delta.content if hasattr(choice, "delta") else choice.text


def stream(client, chat: bool, provenance: bool, **kw) -> list:
    options = {"include_usage": True, "include_provenance": provenance}
    create = client.chat.completions.create if chat else client.completions.create
    body = {"messages": CHAT} if chat else {"prompt": CHAT[0]["content"]}
    return list(create(model=MODEL, stream=True, stream_options=options, **body, **kw))


def check(chunks, drafter: str) -> dict:
    """Every chunk's token texts join to its text; every token comes once, in order; the
    rounds add up to the request's counters. Returns the tokens and rounds by choice."""
    by_choice: dict[int, dict] = {}
    stats = chunks[-1].model_extra["speculation_stats"]
    for chunk in chunks:
        ext = chunk.model_extra.get("specsplit")
        if ext is None:
            continue
        assert "".join(t["text"] for t in ext["tokens"]) == (text_of(chunk) or "")
        seen = by_choice.setdefault(chunk.choices[0].index, {"tokens": [], "rounds": []})
        seen["tokens"] += ext["tokens"]
        seen["rounds"] += ext["rounds"]
    drafted = 0
    for seen in by_choice.values():
        order = [i for i, _ in itertools.groupby(t["i"] for t in seen["tokens"])]
        assert order == list(range(len(order)))  # once each (a split token: twice in a row)
        rounds = seen["rounds"]
        assert [r["round"] for r in rounds] == list(range(1, len(rounds) + 1))
        for r in rounds:
            mine = [t for t in seen["tokens"] if t["round"] == r["round"]]
            sources = [next(g)["source"] for _, g in itertools.groupby(mine, key=lambda t: t["i"])]
            # accepted draft tokens first, then the target's: one a round with a draft, one
            # a forward (a decode step) in a round without
            draft = min(r["accepted"], r["tokens"])
            assert sources == ["draft"] * draft + ["target"] * (r["tokens"] - draft)
            assert all(t.get("drafter") == drafter for t in mine if t["source"] == "draft")
            assert {t["kind"] for t in mine if t["source"] == "target"} <= {"bonus", "correction"}
            assert r["tree_nodes"] >= r["accepted"] and r["verify_ms"] > 0
            drafted += draft
    forwards = [r["forwards"] for s in by_choice.values() for r in s["rounds"]]
    assert min(forwards) >= 1 and sum(forwards) == stats["verify_steps"]
    assert drafted <= stats["accepted_tokens"]
    return by_choice


@pytest.mark.parametrize("chat", [True, False])
def test_provenance_leaves_the_stream_as_it_was(model_client, chat):
    kw = dict(max_tokens=24, temperature=0, extra_body=STATS)
    plain = stream(model_client, chat, False, **kw)
    marked = stream(model_client, chat, True, **kw)
    assert [text_of(c) for c in marked] == [text_of(c) for c in plain]
    assert all("specsplit" not in c.model_extra for c in plain)
    seen = check(marked, "model")[0]
    sources = {t["source"] for t in seen["tokens"]}
    assert sources == {"draft", "target"}  # the tiny draft is often right, not always
    generated = marked[-1].usage.completion_tokens
    assert sum(r["tokens"] for r in seen["rounds"]) == generated
    assert len({t["i"] for t in seen["tokens"]}) == generated


def test_provenance_with_stop_strings_and_several_choices(ngram_client):
    kw = dict(max_tokens=32, temperature=0, n=2, stop=["two three"], extra_body=STATS)
    plain = stream(ngram_client, True, False, **kw)
    marked = stream(ngram_client, True, True, **kw)
    assert texts(marked) == texts(plain)
    by_choice = check(marked, "ngram")
    assert sorted(by_choice) == [0, 1]


def test_provenance_needs_a_stream(ngram_client):
    with pytest.raises(Exception) as refused:
        ngram_client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=4, stream_options={"include_provenance": True}
        )
    assert refused.value.status_code == 400


def test_a_character_held_across_rounds_keeps_each_tokens_round_and_source(byte_tokenizer):
    text, origins = TextStream(byte_tokenizer, []), Provenance()
    a, e1, e2, b = ids(byte_tokenizer, "aéb")  # é is two byte tokens
    sent = []
    for tokens, accepted in (([a, e1], 1), ([e2, b], 1)):  # é's bytes in two rounds
        round_ = Round(
            tokens, None, None, drafted=2, accepted=accepted, corrected=True, seconds=(0.001, 0.002)
        )
        origins.add(round_, "ngram")
        sent.append(origins.take(text.push(tokens)))
    first, second = (
        [(t["i"], t["text"], t["round"], t["source"]) for t in s["tokens"]] for s in sent
    )
    assert first == [(0, "a", 1, "draft")]  # é's first byte waits, with its round's facts
    assert second == [(1, "é", 1, "target"), (2, "", 2, "draft"), (3, "b", 2, "target")]
    assert [r["round"] for r in sent[0]["rounds"] + sent[1]["rounds"]] == [1, 2]
    assert sent[1]["tokens"][0]["kind"] == "correction"


def tree(tokens: list[int], parents: list[int]) -> TokenTree:
    return TokenTree(
        torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long)
    )


@pytest.mark.parametrize(
    "accepted, corrected",
    [([], True), ([0], True), ([0, 1], False), ([2], False)],  # 0 -> 1, and 2 beside 0
)
def test_a_round_says_whether_its_last_token_corrects_a_draft_guess(accepted, corrected):
    state = LoopState(Plan([1, 2], 8, SamplingParams(temperature=0.0)))
    guesses = tree([5, 6, 7], [-1, 0, -1])
    emitted = [[5, 6, 7][i] for i in accepted] + [9]
    round_ = state.commit(guesses, VerifyOutcome(accepted, emitted, None, 0))
    assert round_.corrected is corrected
    alone = LoopState(Plan([1], 4, SamplingParams()))
    empty = alone.commit(tree([], []), VerifyOutcome([], [3], None, 0))
    assert empty.corrected is False  # no draft at all: the target's token is a bonus


def test_the_playground_page_and_script_are_served_without_a_key(ngram_client):
    base = str(ngram_client.base_url).removesuffix("/v1/")
    page = httpx.get(f"{base}/playground")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/static/playground.js">' in page.text
    script = httpx.get(f"{base}/static/playground.js")
    assert script.status_code == 200 and "include_provenance" in script.text
