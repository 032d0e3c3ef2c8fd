"""The suffix cache: tenants isolated, memory bounded, longest matches first."""

from __future__ import annotations

import random

import pytest

from workers.draft.ngram import NgramDrafter
from workers.draft.suffix import SuffixCache, SuffixCacheConfig, tenant_of
from workers.engine.sessions import SessionTable
from workers.protocol import ProposeCall, TreeSpec

ANSWER = [50, 51, 52, 53, 54, 55, 56, 57]
PROMPT = [1, 2, 3, 9]  # ends like the chat template's assistant turn


def drafter(cache: SuffixCache) -> NgramDrafter:
    return NgramDrafter(SessionTable(8), suffixes=cache)


def propose(d: NgramDrafter, session: str, history: list[int], tenant: str):
    (tree,) = d.propose([ProposeCall(session, 0, history, TreeSpec(depth=4, budget=8), tenant)])
    return tree.tokens.tolist()


def test_a_tenants_outputs_never_draft_for_another_tenant():
    cache = SuffixCache(SuffixCacheConfig(context=4))
    alice, bob = tenant_of("key-a"), tenant_of("key-b")
    assert alice != bob and tenant_of(None) == tenant_of("") == ""
    cache.add(alice, PROMPT, ANSWER)
    d = drafter(cache)
    history = [7, 8] + PROMPT + ANSWER[:2]  # the session's own history never repeats
    assert propose(d, "a", history, alice) == ANSWER[2:6]
    assert propose(d, "b", history, bob) == []
    assert propose(d, "none", history, "") == []
    assert cache.continuations(bob, history, 4) == []


def test_without_a_cache_the_drafter_drafts_from_the_session_alone():
    d = NgramDrafter(SessionTable(8))
    assert propose(d, "s", [7, 8] + PROMPT + ANSWER[:2], "") == []


def test_the_longest_match_wins_then_the_most_recent():
    cache = SuffixCache(SuffixCacheConfig(context=8, key_len=2))
    cache.add("t", [40, 41, 1, 2], [60, 61])  # matches [1, 2] only
    cache.add("t", [30, 31, 1, 2], [70, 71])  # matches [31, 1, 2]
    cache.add("t", [20, 21, 1, 2], [80, 81])  # most recent, matches [1, 2] only
    assert cache.continuations("t", [5, 31, 1, 2], 2) == [[70, 71], [80, 81], [60, 61]]


@pytest.mark.parametrize("seed", [0, 1])
def test_memory_stays_within_its_bounds(seed):
    config = SuffixCacheConfig(tokens_per_tenant=200, max_tenants=3, context=4, key_len=2)
    cache = SuffixCache(config)
    rng = random.Random(seed)
    for _ in range(300):
        tenant = f"t{rng.randrange(5)}"
        output = [rng.randrange(6) for _ in range(rng.randrange(1, 260))]
        cache.add(tenant, [rng.randrange(6) for _ in range(6)], output)
        assert len(cache.tenants) <= 3
        for entry in cache.tenants.values():
            assert entry.size == len(entry.tokens) == sum(entry.lengths) <= 200
            # the index holds exactly the places of the outputs still cached
            places = sorted(p for ps in entry.index.values() for p in ps)
            assert len(places) == sum(n - 3 for n in entry.lengths)  # key_len 2, and SEP
            assert not places or places[0] >= entry.base
        assert cache.size <= 3 * 200
        cache.continuations(tenant, output[-5:], 4)  # a lookup never fails on evicted places


def test_the_least_recently_used_tenant_goes_first():
    cache = SuffixCache(SuffixCacheConfig(max_tenants=2, context=0, key_len=2))
    cache.add("a", [], [1, 2, 3])
    cache.add("b", [], [1, 2, 4])
    assert cache.continuations("a", [1, 2], 1) == [[3]]  # a is now the most recent
    cache.add("c", [], [1, 2, 5])
    assert list(cache.tenants) == ["a", "c"]
