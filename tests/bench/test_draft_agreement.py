"""`bench draft`'s teacher-forced agreement reads only the cache entries it writes, so its
figures do not depend on what the KV pool's memory held before (the pool is torch.empty)."""

from __future__ import annotations

import pytest

from tests.decoding.test_feature_draft import eagle_engine
from tests.engine.tiny import tiny_engine
from workers.engine.batch import SlotInput
from workers.engine.engine import Engine
from workers.tools.bench.draft import agreement

PROMPT = [5, 17, 42, 8, 63]


def held(engine: Engine, value: float) -> Engine:
    """`engine` with every KV pool position but the null block holding `value`."""
    for pool in (engine.cache.k, engine.cache.v):
        pool[:, :, engine.cache.block_size :] = value
    return engine


def greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    """The target's next `n` greedy tokens, each from a fresh forward of the whole sequence."""
    seq = list(prompt)
    for _ in range(n):
        row = SlotInput(0, 0, list(range(-1, len(seq) - 1)), seq)
        seq.append(int(engine.forward([row])[0][-1].argmax()))
    return seq[len(prompt) :]


@pytest.mark.parametrize("value", [0.0, float("nan")])
def test_a_target_agrees_with_its_own_greedy_answer(value):
    engine = tiny_engine()
    answer = greedy(engine, PROMPT, 6)
    assert agreement(held(engine, value), engine, PROMPT, answer) == (6, 6, 6)


def test_a_heads_agreement_is_the_same_whatever_the_pools_held():
    target, prompt = tiny_engine(seed=1, vocab=16), [x % 16 for x in PROMPT]
    answer = greedy(target, prompt, 24)
    figures = [
        agreement(held(eagle_engine(1, vocab=16), value), held(target, value), prompt, answer)
        for value in (0.0, 1e4, float("nan"))
    ]
    assert figures[0] == figures[1] == figures[2]
