"""The paged KV cache: blocks are taken and returned as sessions grow and end, and a
session's cached keys and values stay those of a fresh prefill of its tokens through
propose/verify/commit rounds, evictions (preemption when the pool is short) and re-sends."""

import asyncio
import uuid

import pytest
import torch

from tests.decoding.test_greedy_lossless import GREEDY, PROMPTS, perturbed_draft, target_only
from tests.engine.tiny import tiny_hf_model
from workers.draft.runner import ModelDrafter
from workers.engine.engine import Engine, EngineConfig
from workers.engine.kv_cache import OutOfBlocks, PagedKVCache
from workers.engine.sessions import SessionTable
from workers.loop import Loop, LoopState, Pair, Plan
from workers.loop.inprocess import InProcessDraft, InProcessTarget
from workers.protocol import TreeSpec, VerifyCall
from workers.speculation.tree import TokenTree
from workers.target.runner import TargetRunner


def test_blocks_are_taken_trimmed_and_returned():
    cache = PagedKVCache(1, 2, 1, 4, 64, num_tokens=48, dtype=torch.float32, device="cpu")
    assert cache.capacity_tokens == 48  # 3 blocks of 16, and the null block
    cache.reserve(0, 20)  # 2 blocks
    cache.reserve(0, 17)  # already held
    assert cache.used_tokens == 32
    with pytest.raises(OutOfBlocks):
        cache.reserve(1, 40)  # 3 blocks, 1 free
    cache.trim(0, 16)  # keeps 1 block
    cache.reserve(1, 32)
    assert cache.used_tokens == 48 and not cache.free
    cache.release(1)
    cache.release(0)
    assert cache.used_tokens == 0 and len(cache.free) == 3


def test_a_full_pool_evicts_the_least_recently_used_session_outside_the_batch():
    engine = Engine.from_hf(
        tiny_hf_model(), None, EngineConfig(max_sessions=3, max_seq_len=256, kv_tokens=64), "t"
    )
    runner = TargetRunner(engine, SessionTable(3))
    # 2 blocks each with its tree room, and no prefix shared (no block held twice)
    prompts = {sid: list(range(i, i + 30)) for i, sid in enumerate("abc")}
    for sid in ("a", "b"):
        runner.verify([VerifyCall(sid, 0, prompts[sid], TokenTree.empty(), GREEDY)])
    (outcome,) = runner.verify([VerifyCall("c", 0, prompts["c"], TokenTree.empty(), GREEDY)])
    assert not isinstance(outcome, Exception)
    assert list(runner.table.sessions) == ["b", "c"] and runner.table.evictions == 1
    (busy,) = runner.verify([VerifyCall("d", 0, list(range(1, 70)), TokenTree.empty(), GREEDY)])
    assert isinstance(busy, OutOfBlocks)  # more than the whole pool: refused, nobody evicted


async def test_cache_stays_exact_through_rounds_evictions_and_resends():
    """Four sessions share a pool that holds two: they preempt one another (re-sending their
    histories), their texts equal their solo greedy runs, and every cache a session holds at
    the end equals a fresh prefill of its tokens."""
    hf = tiny_hf_model(seed=0)
    config = EngineConfig(max_sessions=4, max_seq_len=256, kv_tokens=128)
    target = Engine.from_hf(hf, None, config, "t")
    runner = TargetRunner(target, SessionTable(4))
    drafter = ModelDrafter(perturbed_draft(0, 0.01, slots=4), SessionTable(4))

    async def generate(prompt: list[int]) -> list[int]:
        route = await Pair.of(
            InProcessTarget("t", runner, threaded=False), InProcessDraft("d", drafter, False)
        )
        plan = Plan(prompt, 40, GREEDY, TreeSpec(4, 2, 8))
        loop = Loop(LoopState(plan), route, uuid.uuid4().hex, keep=True)
        async for _ in loop.rounds():
            await asyncio.sleep(0)  # let the other sessions run between rounds
        return loop.state.generated

    prompts = [*PROMPTS, [9, 8, 7, 6, 5, 4, 3]]
    texts = await asyncio.gather(*(generate(p) for p in prompts))
    for prompt, text in zip(prompts, texts, strict=True):
        assert text == await target_only(0, prompt, 40)
    assert runner.table.evictions > 0
    fresh = Engine.from_hf(hf, None, EngineConfig(max_sessions=1, max_seq_len=256), "fresh")
    for session in runner.table.sessions.values():
        n = session.cached
        assert n > 40
        fresh_runner = TargetRunner(fresh, SessionTable(1))
        call = VerifyCall("x", 0, session.committed[: n + 1], TokenTree.empty(), GREEDY)
        fresh_runner.verify([call])
        ours, theirs = target.cache.entries(session.slot, n), fresh.cache.entries(0, n)
        assert torch.allclose(ours[0], theirs[0], atol=1e-4)
        assert torch.allclose(ours[1], theirs[1], atol=1e-4)
