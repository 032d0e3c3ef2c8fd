"""Speculative greedy output equals target-only greedy output, token for token, through the
one loop the gateway runs, with in-process backends and with real gRPC workers."""

import asyncio
import uuid

import pytest
import torch

from tests.decoding.pairs import NGRAM, TRANSPORTS, pair, run
from tests.engine.tiny import tiny_engine, tiny_hf_model
from workers.draft.ngram import NgramDrafter
from workers.draft.runner import ModelDrafter
from workers.engine.engine import Engine, EngineConfig
from workers.engine.sessions import SessionTable
from workers.loop import Loop, LoopState, Pair, Plan
from workers.loop.inprocess import InProcessDraft, InProcessTarget, LocalDecoder
from workers.protocol import TreeSpec, VerifyCall
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree
from workers.target.runner import TargetRunner

GREEDY = SamplingParams()


async def target_only(seed: int, prompt: list[int], n: int) -> list[int]:
    """The tiny target's own greedy tokens (the loop with no draft)."""
    engine = tiny_engine(seed=seed, slots=2)
    decoder = LocalDecoder(TargetRunner(engine, SessionTable(2)))
    return (await decoder.agenerate(prompt, n, GREEDY)).token_ids


def hf_greedy(seed: int, prompt: list[int], n: int) -> list[int]:
    hf = tiny_hf_model(seed=seed)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n
        )
    return out[0, len(prompt) :].tolist()


def perturbed_draft(seed: int, noise: float, slots: int = 2) -> Engine:
    """A copy of the target with noisy weights: accepts some nodes, not all."""
    hf = tiny_hf_model(seed=seed)
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise)
    return Engine.from_hf(hf, None, EngineConfig(max_sessions=slots, max_seq_len=256), "draft")


PROMPTS = [[5, 17, 3, 88, 41, 5, 17], list(range(20, 32)), [7] * 9]


@pytest.mark.parametrize("seed", [0, 1])
async def test_target_only_equals_transformers_generate(seed):
    for prompt in PROMPTS:
        assert await target_only(seed, prompt, 24) == hf_greedy(seed, prompt, 24)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    "spec",
    [
        TreeSpec(depth=4, branching=1, budget=4),
        TreeSpec(depth=3, branching=2, budget=8),
        TreeSpec(depth=5, branching=3, budget=16),
        TreeSpec(depth=2, branching=4, budget=6),
    ],
)
@pytest.mark.parametrize("seed", [0, 2])
async def test_model_draft_tree_is_lossless(transport, spec, seed):
    async with pair(transport, tiny_engine(seed=seed, slots=2), perturbed_draft(seed, 0.01)) as p:
        for prompt in PROMPTS:
            gen = await run(p, prompt, 30, spec)
            assert gen.token_ids == await target_only(seed, prompt, 30)
            assert gen.stats.verify_steps < 30  # the draft helped at least once


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_partial_acceptance_happens(transport):
    """The perturbed draft is accepted sometimes but not always."""
    async with pair(transport, tiny_engine(seed=0), perturbed_draft(0, noise=0.01)) as p:
        stats = (await run(p, PROMPTS[1], 40, TreeSpec(depth=4, branching=2, budget=8))).stats
    assert 0.0 < stats.acceptance_rate < 1.0


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("spec", [TreeSpec(depth=4, branching=1), TreeSpec(depth=6, budget=12)])
async def test_ngram_draft_is_lossless(transport, spec):
    async with pair(transport, tiny_engine(seed=1, slots=2), NGRAM) as p:
        for prompt in PROMPTS:
            assert (await run(p, prompt, 30, spec)).token_ids == await target_only(1, prompt, 30)


async def test_the_tree_never_exceeds_the_targets_limit():
    """The loop caps every tree at the target's max_tree_nodes (a larger one is refused)."""
    runner = TargetRunner(tiny_engine(seed=0, slots=2), SessionTable(2), max_tree_nodes=4)
    route = await Pair.of(
        InProcessTarget("t", runner, threaded=False),
        InProcessDraft("d", NgramDrafter(SessionTable(8)), threaded=False),
    )
    gen = await run(route, PROMPTS[2], 30, TreeSpec(depth=6, budget=64))
    assert gen.token_ids == await target_only(0, PROMPTS[2], 30)
    assert 0 < gen.stats.draft_tokens <= 4 * gen.stats.verify_steps


def test_kv_cache_after_many_rounds_equals_fresh_prefill():
    """After many propose/verify/commit rounds of the loop, the slot's keys and values equal
    a fresh prefill of the session's tokens."""

    from workers.loop import Pair
    from workers.loop.inprocess import InProcessDraft

    target = tiny_engine(seed=0, slots=2)
    runner = TargetRunner(target, SessionTable(2))
    drafter = ModelDrafter(perturbed_draft(0, 0.01), SessionTable(2))

    async def rounds() -> int:
        route = await Pair.of(
            InProcessTarget("t", runner, threaded=False), InProcessDraft("d", drafter, False)
        )
        plan = Plan(PROMPTS[0], 40, GREEDY, TreeSpec(4, 2, 8))
        loop = Loop(LoopState(plan), route, uuid.uuid4().hex, keep=True)  # keeps the slot
        async for _ in loop.rounds():
            pass
        return loop.counters.verify_steps

    assert asyncio.run(rounds()) > 5
    (session,) = runner.table.sessions.values()
    n = session.cached
    fresh = tiny_engine(seed=0, slots=1)
    fresh_runner = TargetRunner(fresh, SessionTable(1))
    fresh_runner.verify([VerifyCall("x", 0, session.committed[: n + 1], TokenTree.empty(), GREEDY)])
    ours, theirs = target.cache.entries(session.slot, n), fresh.cache.entries(0, n)
    assert torch.allclose(ours[0], theirs[0], atol=1e-4)
    assert torch.allclose(ours[1], theirs[1], atol=1e-4)
