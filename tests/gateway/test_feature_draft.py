"""A feature (EAGLE-style) draft behind the gateway: the output is the target's, through
the pool's routing, with the look-ahead on, merged with the n-gram draft (hybrid), and
across a failover to another head."""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.engine.tiny import tiny_config
from tests.gateway.helpers import MODEL, live, model_draft, target, word_tokenizer
from workers.engine.eagle import init_eagle_head, save_eagle_head

CHAT = [{"role": "user", "content": "one two three four five"}]
GREEDY = dict(model=MODEL, messages=CHAT, max_tokens=40, temperature=0)


def client_of(gateway) -> OpenAI:
    return OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def plain_text(tiny_dir) -> str:
    with live(tiny_dir, [target(tiny_dir)]) as gateway:
        return client_of(gateway).chat.completions.create(**GREEDY).choices[0].message.content


@pytest.mark.parametrize(
    "overlap, hybrid", [(False, False), (True, False), (False, True)], ids=["", "overlap", "hybrid"]
)
def test_a_feature_draft_gives_the_targets_greedy_text(
    tiny_dir, tiny_eagle_dir, plain_text, overlap, hybrid
):
    backends = [target(tiny_dir), model_draft(tiny_eagle_dir)]
    with live(tiny_dir, backends, overlap_draft=overlap, hybrid_draft=hybrid) as gateway:
        reply = client_of(gateway).chat.completions.create(
            extra_body={"speculation_stats": True}, **GREEDY
        )
        assert reply.choices[0].message.content == plain_text
        stats = reply.model_extra["speculation_stats"]
        assert stats["draft_tokens"] > 0 and stats["degraded_rounds"] == 0


def test_a_failover_to_another_feature_draft_keeps_the_text(tiny_dir, tiny_eagle_dir, plain_text):
    """The first head dies mid-stream; the second gets the whole history and the latest
    round's states only, and drafts on."""
    heads = [model_draft(tiny_eagle_dir, "d0"), model_draft(tiny_eagle_dir, "d1")]
    calls = {head.address: [] for head in heads}
    for head in heads:
        propose = head.drafter.propose

        def recorded(batch, propose=propose, seen=calls[head.address]):
            seen.extend(batch)
            return propose(batch)

        head.drafter.propose = recorded
    with live(tiny_dir, [target(tiny_dir), *heads]) as gateway:
        text, stopped = "", []
        stream = client_of(gateway).chat.completions.create(stream=True, **GREEDY)
        for i, chunk in enumerate(stream):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if i == 3:
                stopped.append(next(head for head in heads if calls[head.address]))
                stopped[0].stop()
        assert stopped and text == plain_text
    (survivor,) = [head for head in heads if head is not stopped[0]]
    first, *later = calls[survivor.address]
    assert first.base_len == 0 and first.features is not None  # the latest round's states
    assert first.features.end == len(first.tokens) - 1  # up to the state before the last token
    assert later and all(c.base_len > 0 for c in later)  # then it drafts on from there


def test_a_head_of_another_width_is_never_bound(tiny_dir, tiny_eagle_dir, plain_text, tmp_path):
    """A pool that also holds a head trained for a narrower target: every session binds the
    head of its target's width, so no round goes without a draft."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(vocab=len(word_tokenizer()))
    config.hidden_size, config.intermediate_size = 32, 64
    narrow, fuse = init_eagle_head(AutoModelForCausalLM.from_config(config), seed=6)
    narrow_dir = save_eagle_head(tmp_path / "narrow", narrow, fuse, word_tokenizer())
    heads = [model_draft(narrow_dir, "d0"), model_draft(tiny_eagle_dir, "d1")]
    asked = []
    propose = heads[0].drafter.propose
    heads[0].drafter.propose = lambda batch: asked.extend(batch) or propose(batch)
    with live(tiny_dir, [target(tiny_dir), *heads]) as gateway:
        for _ in range(3):  # a new session each: the least loaded head would be d0 in turn
            reply = client_of(gateway).chat.completions.create(
                extra_body={"speculation_stats": True}, **GREEDY
            )
            assert reply.choices[0].message.content == plain_text
            stats = reply.model_extra["speculation_stats"]
            assert stats["draft_tokens"] > 0 and stats["degraded_rounds"] == 0
    assert asked == []


def test_provenance_names_a_feature_draft(tiny_dir, tiny_eagle_dir, plain_text):
    with live(tiny_dir, [target(tiny_dir), model_draft(tiny_eagle_dir)]) as gateway:
        stream = client_of(gateway).chat.completions.create(
            stream=True, stream_options={"include_provenance": True}, **GREEDY
        )
        text, rounds = "", []
        for chunk in stream:
            text += chunk.choices[0].delta.content or "" if chunk.choices else ""
            rounds += (chunk.model_extra.get("specsplit") or {}).get("rounds", [])
    assert text == plain_text
    assert {r["drafter"] for r in rounds if r["tree_nodes"]} == {"feature"}
