"""Automatic prefix caching: sessions share the full KV blocks of a common prompt prefix,
a session never writes into a block another holds, idle cached blocks go only when the pool
needs them, and a hit changes no logit of the float32 engine."""

import asyncio
import uuid

import pytest
import torch

from tests.decoding.test_greedy_lossless import GREEDY, perturbed_draft, target_only
from tests.engine.tiny import tiny_hf_model
from workers.draft.runner import ModelDrafter
from workers.engine.engine import Engine, EngineConfig
from workers.engine.kv_cache import NULL_BLOCK, OutOfBlocks, PagedKVCache
from workers.engine.sessions import SessionTable
from workers.loop import Loop, LoopState, Pair, Plan
from workers.loop.inprocess import InProcessDraft, InProcessTarget
from workers.protocol import TreeSpec, VerifyCall
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree
from workers.target.runner import TargetRunner

TOKENS = list(range(1, 61))


def shared_cache(blocks: int = 8, slots: int = 3) -> PagedKVCache:
    return PagedKVCache(
        1, slots, 1, 4, 128, num_tokens=16 * blocks, dtype=torch.float32, device="cpu",
        share_prefixes=True,
    )  # fmt: skip


def blocks_of(cache: PagedKVCache, slot: int) -> list[int]:
    return cache.tables[slot, : cache.held[slot]].tolist()


def test_a_published_prefix_is_adopted_by_whole_blocks():
    cache = shared_cache()
    cache.reserve(0, 41)
    cache.publish(0, TOKENS, 40)  # blocks 0 and 1 are full; block 2 is not
    assert cache.cached_tokens == 32
    assert cache.adopt(1, TOKENS[:35] + [99], hit=0) == 32  # shares the first 32 tokens
    assert blocks_of(cache, 1) == blocks_of(cache, 0)[:2]
    assert cache.used_tokens == 48  # shared blocks count once
    assert cache.adopt(2, [0, *TOKENS[1:40]], hit=0) == 0  # the first block differs
    # the history's last token is fed again for its logits: 32 tokens reuse one block
    assert cache.adopt(2, TOKENS[:32], hit=0) == 16
    # a longer hit of the slot's own wins over a shorter shared one
    cache.reserve(2, 30)
    assert cache.adopt(2, TOKENS[:30], hit=20) == 20


def test_a_slot_never_writes_into_a_block_it_shares():
    cache = shared_cache()
    cache.reserve(0, 48)
    cache.publish(0, TOKENS, 48)
    assert cache.adopt(1, TOKENS[:49], hit=0) == 48
    # slot 1 goes back to column 20, inside the block both hold: it drops back to 16
    assert cache.rewind(1, 20) == 16
    assert cache.held[1] == 1 and cache.tables[1, 1] == NULL_BLOCK
    cache.release(1)
    # slot 0 alone holds that block: it keeps 20 columns, and the block is no longer shared
    block = blocks_of(cache, 0)[1]
    assert cache.rewind(0, 20) == 20
    assert not cache.prefixes.published(block) and cache.adopt(1, TOKENS[:49], hit=0) == 16


def test_idle_blocks_stay_cached_until_the_pool_needs_them():
    cache = shared_cache(blocks=4)
    cache.reserve(0, 48)
    cache.publish(0, TOKENS, 48)
    first, second, third = blocks_of(cache, 0)
    cache.release(0)
    assert cache.used_tokens == 0 and cache.cached_tokens == 48
    assert cache.adopt(1, TOKENS[:49], hit=0) == 48  # cached with no session holding it
    cache.release(1)
    cache.reserve(2, 32)  # the free block, then the least recently released: the deepest
    assert third in blocks_of(cache, 2) and cache.cached_tokens == 32
    assert cache.adopt(1, TOKENS[:49], hit=0) == 32
    assert blocks_of(cache, 1) == [first, second]
    with pytest.raises(OutOfBlocks):
        cache.reserve(0, 16)  # every block is held


def engines(prefix_caching: bool, slots: int = 4) -> Engine:
    config = EngineConfig(max_sessions=slots, max_seq_len=256, prefix_caching=prefix_caching)
    return Engine.from_hf(tiny_hf_model(seed=0), None, config, "t")


async def generate(runner, drafter, prompt, params, n=24) -> list[int]:
    route = await Pair.of(
        InProcessTarget("t", runner, threaded=False), InProcessDraft("d", drafter, False)
    )
    loop = Loop(LoopState(Plan(prompt, n, params, TreeSpec(4, 2, 8))), route, uuid.uuid4().hex)
    async for _ in loop.rounds():
        await asyncio.sleep(0)  # let the other sessions run between rounds
    return loop.state.generated


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0, seed=5)])
async def test_sessions_sharing_a_system_prompt_get_the_same_tokens_as_without(params):
    """Four sessions open with the same 40-token system prompt: every one after the first
    finds its first two blocks cached, and each text equals that of an engine without prefix
    caching (the target-only greedy text where greedy); so do the keys and values, bit for
    bit, of every session cached at the end."""
    system = [(7 * i) % 90 + 3 for i in range(40)]
    prompts = [system + [9, 8, 7 - i] for i in range(4)]
    texts, caches = {}, {}
    for sharing in (True, False):
        target = engines(sharing)
        runner = TargetRunner(target, SessionTable(4))
        drafter = ModelDrafter(perturbed_draft(0, 0.01, slots=4), SessionTable(4))
        texts[sharing] = [await generate(runner, drafter, prompts[0], params)]
        texts[sharing] += await asyncio.gather(
            *(generate(runner, drafter, p, params) for p in prompts[1:])
        )
        caches[sharing] = [
            target.cache.entries(s.slot, s.cached) for s in runner.table.sessions.values()
        ]
        assert runner.table.hit_tokens == (96 if sharing else 0)
    assert texts[True] == texts[False]
    if params is GREEDY:
        for prompt, text in zip(prompts, texts[True], strict=True):
            assert text == await target_only(0, prompt, 24)
    for ours, theirs in zip(caches[True], caches[False], strict=True):
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def test_a_session_diverging_inside_a_shared_block_leaves_the_others_intact():
    """Session b restarts from a history that leaves the shared prefix mid-block: it recomputes
    that block in one of its own, and session a's next rounds still equal a fresh engine's."""
    prompt = list(range(3, 43))

    def rounds(runner: TargetRunner, sid: str) -> list[int]:
        """Two more rounds of a session holding `prompt` and the token its prefill emitted."""
        n = len(prompt) + 1
        return verify(runner, sid, [], n).emitted + verify(runner, sid, [], n + 1).emitted

    runner = TargetRunner(engines(True), SessionTable(4))
    verify(runner, "a", prompt)
    assert verify(runner, "b", prompt[:-1] + [5]).prefix_hit == 32
    assert verify(runner, "b", prompt[:20] + [1, 2, 3]).prefix_hit == 16
    fresh = TargetRunner(engines(False), SessionTable(1))
    verify(fresh, "a", prompt)
    assert rounds(runner, "a") == rounds(fresh, "a")


def test_sessions_share_prefixes_only_under_the_same_salt():
    """A salted session adopts only blocks published under its salt, an unsalted one only
    unsalted blocks; a session restarting under another salt keeps none of its own."""
    prompt = list(range(3, 43))
    runner = TargetRunner(engines(True, slots=6), SessionTable(6))
    assert verify(runner, "a", prompt, salt="x").prefix_hit == 0
    assert verify(runner, "b", prompt, salt="y").prefix_hit == 0
    assert verify(runner, "c", prompt).prefix_hit == 0
    assert verify(runner, "d", prompt, salt="x").prefix_hit == 32
    assert verify(runner, "e", prompt).prefix_hit == 32
    assert verify(runner, "a", prompt, salt="z").prefix_hit == 0
    assert verify(runner, "a", prompt, salt="z").prefix_hit == 39  # its own slot, same salt
    assert verify(runner, "f", prompt, salt="z").prefix_hit == 32


def verify(runner: TargetRunner, sid: str, tokens: list[int], base: int = 0, salt: str = ""):
    call = VerifyCall(sid, base, tokens, TokenTree.empty(), GREEDY, cache_salt=salt)
    (outcome,) = runner.verify([call])
    assert not isinstance(outcome, Exception), outcome
    return outcome
