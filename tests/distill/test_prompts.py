"""Distillation's prompt sets: held-out fillers are never trained on, the `unlike` set asks
for no kind a template does, and the teacher answers every turn of a conversation with the
conversation so far."""

from __future__ import annotations

import itertools
import re

import pytest
from transformers import AutoModelForCausalLM

from tests.distill.conftest import tiny_tokenizer
from workers.engine.engine import Engine, EngineConfig
from workers.tools.distill import prompts
from workers.tools.distill.data import DataSpec, Teacher, answer, request_batches

FILLER_POOLS = [*prompts._SLOTS.values(), prompts.FOREIGN_TOPICS]


def first(split: str, n: int, seed: int = 0) -> list[prompts.Request]:
    return list(itertools.islice(prompts.requests(split, seed), n))


def pattern(template: str) -> re.Pattern:
    """A template as a regex: each slot matches any text."""
    parts = re.split(r"\{\w+\}", template)
    return re.compile(".+".join(re.escape(part) for part in parts), re.DOTALL)


@pytest.mark.parametrize("pools", FILLER_POOLS, ids=lambda p: repr(p[1][0])[:24])
def test_held_out_fillers_are_never_train_fillers(pools):
    train, heldout = pools
    assert heldout and not set(train) & set(heldout)


def test_the_splits_are_seeded_and_train_holds_every_kind_and_shape():
    train = first("train", 3000)
    assert train == first("train", 3000) and train[:50] != first("train", 50, seed=1)
    assert not {r.turns for r in train} & {r.turns for r in first("heldout", 300)}
    shapes = {(len(r.turns), r.long) for r in train}
    assert shapes == {(1, False), (2, False), (1, True)}
    texts = [r.turns[0] for r in train]
    for template in prompts.TEMPLATES + prompts.LONG_TEMPLATES:
        assert any(pattern(template).fullmatch(t) for t in texts), template
    follow_ups = {r.turns[1] for r in train if len(r.turns) == 2}
    assert follow_ups == set(prompts.FOLLOW_UPS)


def test_unlike_asks_for_no_kind_a_template_asks_for():
    unlike = first("unlike", 1000)
    assert sorted(r.turns[0] for r in unlike) == sorted(prompts.UNLIKE)
    templates = [pattern(t) for t in prompts.TEMPLATES + prompts.LONG_TEMPLATES]
    for text in prompts.UNLIKE:
        assert not any(t.fullmatch(text) for t in templates), text
    assert prompts.take("unlike", 0, 5) == [r.turns[0] for r in unlike[:5]]


def test_train_batches_group_by_shape_and_held_out_batches_keep_the_order():
    spec = DataSpec(0, 12, 8, 16, batch_size=8, top_k=4, seed=0)
    for batch in itertools.islice(request_batches("train", spec), 40):
        assert len({(len(r.turns), r.long) for r in batch}) == 1
    held = list(itertools.islice(request_batches("heldout", spec), 3))
    assert [r for b in held for r in b] == first("heldout", 24)


def test_every_turn_is_answered_after_the_conversation_so_far(tiny_target):
    tokenizer = tiny_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(tiny_target)
    engine = Engine.from_hf(model, tokenizer, EngineConfig(max_sessions=4, max_seq_len=256), "t")
    teacher = Teacher(engine, tokenizer)
    spec = DataSpec(0, 0, max_new_tokens=5, long_new_tokens=11, batch_size=4, top_k=3, seed=0)
    requests = [
        prompts.Request(("Explain the water cycle in simple terms.", "Why is that?")),
        prompts.Request(("Write a long story about a robot who learns to paint.",), long=True),
        prompts.Request(("What is coffee?",)),
    ]
    first_turn, second_turn, long, short = answer(teacher, requests, spec)
    for e, limit in [(first_turn, 5), (second_turn, 5), (long, 11), (short, 5)]:
        assert e.answer_len == limit or e.ids[-1] == tokenizer.eos_token_id
        assert e.top_ids.shape == (len(e.ids) - 1, 3)
    head = first_turn.prompt_len  # the second prompt is the first, its answer, the follow-up
    assert second_turn.ids[:head] == first_turn.ids[:head]
    said = tokenizer.decode(first_turn.ids[head:], skip_special_tokens=True)
    asked = tokenizer.decode(second_turn.ids[: second_turn.prompt_len], skip_special_tokens=True)
    assert said in asked and asked.index(said) < asked.index("Why is that ?")
