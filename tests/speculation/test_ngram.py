"""Prompt-lookup trees: matching, merging, ordering, budget and closure."""

from __future__ import annotations

import time

import pytest
import torch

from workers.draft.ngram import NgramDrafter
from workers.engine.sessions import SessionTable
from workers.protocol import ProposeCall, SessionLost, TreeSpec
from workers.speculation import children, depths, ngram_tree
from workers.speculation.ngram import BULK, SuffixIndex, match_length


def as_lists(tree) -> tuple[list[int], list[int]]:
    return tree.tokens.tolist(), tree.parents.tolist()


def test_single_match_gives_its_continuation():
    history = [5, 6, 7, 8, 9, 1, 2, 5, 6]
    tree = ngram_tree(history, max_ngram=2, depth=4)
    assert as_lists(tree) == ([7, 8, 9, 1], [-1, 0, 1, 2])
    assert tree.q_tokens is None and tree.q_probs is None


def test_continuation_stops_at_history_end_and_depth():
    assert as_lists(ngram_tree([1, 2, 3, 1, 2], max_ngram=2, depth=8)) == ([3, 1, 2], [-1, 0, 1])
    assert as_lists(ngram_tree([1, 2, 3, 4, 1, 2], depth=1)) == ([3], [-1])


def test_matches_merge_into_a_trie_ordered_by_support_then_recency():
    # suffix (1, 2) occurs three times before: followed by 3 4 | 3 9 | 7 7 (oldest first)
    history = [1, 2, 3, 4, 0, 1, 2, 3, 9, 0, 1, 2, 7, 7, 0, 1, 2]
    tokens, parents = as_lists(ngram_tree(history, max_ngram=2, depth=2))
    # numbering follows (support desc, recency, depth): 3 (support 2) first, then the
    # most recent continuation 7 -> 7, then 3's children, 9 (more recent) before 4
    assert tokens == [3, 7, 7, 9, 4]
    assert parents == [-1, -1, 1, 0, 0]


def test_longest_ngram_wins():
    # the 3-gram (1, 2, 3) occurs once (followed by 4); the 1-gram 3 also occurs before 8
    history = [3, 8, 1, 2, 3, 4, 5, 1, 2, 3]
    assert ngram_tree(history, max_ngram=3, depth=1).tokens.tolist() == [4]
    both = ngram_tree(history, max_ngram=1, depth=1).tokens.tolist()
    assert both == [4, 8]  # with n = 1 both occurrences, most recent first


def test_the_match_length_is_the_suffix_the_tree_copies_after():
    history = [3, 8, 1, 2, 3, 4, 5, 1, 2, 3]
    assert match_length(history) == 3
    assert match_length(history, max_ngram=1) == 1
    assert match_length([5, 7, 9, 5]) == 1  # (9, 5) never occurred: only 5 did
    assert match_length([1, 2, 3, 4]) == match_length([7]) == match_length([]) == 0


def test_the_agreement_counts_back_from_the_latest_match_up_to_its_limit():
    # (1, 2, 3) ended at 4 and at 10; the latest (10) agrees 5 tokens back: 8 9 1 2 3
    history = [7, 8, 1, 2, 3, 0, 8, 9, 1, 2, 3, 4, 8, 9, 1, 2, 3]
    index = SuffixIndex()
    index.extend(history)
    assert index.agreement(16) == 5
    assert index.agreement(4) == 4
    assert index.agreement(1) == 3  # the match itself is never cut
    whole = SuffixIndex()
    whole.extend([4, 5, 6, 4, 5, 6, 4, 5, 6])  # the latest match starts the history: 6 agree
    assert whole.agreement(16) == 6
    nothing = SuffixIndex()
    nothing.extend([1, 2, 3, 4])
    assert nothing.agreement(16) == 0


def reference_matches(
    history: list[int], most: int, least: int, window: int, limit: int
) -> tuple[int, list[int]]:
    """The definition, by brute force: the longest suffix n-gram (most >= n >= least) with
    an earlier occurrence that starts within the last `window` tokens and is followed by a
    token; where up to `limit` of them end, most recent first."""
    size = len(history)
    for n in range(min(most, size - 1), least - 1, -1):
        suffix = history[size - n :]
        ends = [
            end
            for end in range(size - 2, n - 2, -1)
            if history[end - n + 1 : end + 1] == suffix and end - n + 1 >= size - window
        ]
        if ends:
            return n, ends[:limit]
    return 0, []


@pytest.mark.parametrize("vocab,window", [(2, 4096), (3, 5), (5, 30), (20, 2)])
def test_the_suffix_index_follows_a_growing_and_shrinking_history(vocab, window):
    gen = torch.Generator().manual_seed(vocab)
    history: list[int] = []
    index = SuffixIndex(window=window)
    assert index.match_length() == 0 and index.matches(limit=4) == (0, [])
    for step in range(200):
        if step % 7 == 6:  # a guess that ran ahead, dropped
            keep = max(0, len(history) - int(torch.randint(1, 5, ())))
            history = history[:keep]
            index.truncate(keep)
        else:
            # a round's one to three tokens; every tenth step a run longer than BULK (a
            # prompt, a re-sent history), which the index takes n by n
            size = torch.randint(1, 4, ()) if step % 10 else torch.randint(BULK + 1, 3 * BULK, ())
            new = torch.randint(0, vocab, (int(size),), generator=gen).tolist()
            history += new
            index.extend(new)
        assert index.tokens == history
        for most in (1, 2, 3):
            for least in range(1, most + 1):
                for limit in (1, 3, 8):
                    expected = reference_matches(history, most, least, window, limit)
                    assert index.matches(most, least, limit) == expected
                assert index.match_length(most, least) == expected[0]
                assert match_length(history, most, least, window) == expected[0]
    index.truncate(0)
    assert index.ends == {} and len(index) == 0


def test_a_tree_from_an_index_is_the_tree_from_its_history():
    gen = torch.Generator().manual_seed(3)
    history = torch.randint(0, 6, (300,), generator=gen).tolist()
    index = SuffixIndex()
    for at in range(0, 300, 7):
        index.extend(history[len(index) : at])
        for kwargs in ({}, {"max_ngram": 2, "depth": 3, "budget": 5}, {"chain": True}):
            from_index, from_list = ngram_tree(index, **kwargs), ngram_tree(history[:at], **kwargs)
            assert as_lists(from_index) == as_lists(from_list)


def test_no_match_and_degenerate_inputs_give_empty_tree():
    assert len(ngram_tree([1, 2, 3, 4])) == 0
    assert len(ngram_tree([])) == 0
    assert len(ngram_tree([7])) == 0
    assert len(ngram_tree([1, 2, 1, 2], budget=0)) == 0
    assert len(ngram_tree([1, 2, 3, 1, 2], min_ngram=3, max_ngram=3)) == 0


def test_max_matches_and_window():
    history = [1, 2] * 50 + [1]
    tree = ngram_tree(history, max_ngram=1, depth=1, max_matches=3)
    assert as_lists(tree) == ([2], [-1])  # 3 identical continuations merge into one node
    far = [9, 4] + [0] * 100 + [9]
    assert ngram_tree(far, max_ngram=1, depth=1).tokens.tolist() == [4]
    assert len(ngram_tree(far, max_ngram=1, depth=1, window=50)) == 0


def test_budget_keeps_a_closed_prefix():
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        history = torch.randint(0, 4, (200,), generator=gen)  # tensors are accepted too
        full = ngram_tree(history, max_ngram=2, depth=6, budget=10_000, max_matches=8)
        assert len(full) > 0
        kids = children(full.parents)
        for b in range(len(full) + 1):
            trimmed = ngram_tree(history, max_ngram=2, depth=6, budget=b, max_matches=8)
            assert len(trimmed) == b
            assert torch.equal(trimmed.tokens, full.tokens[:b])
            assert torch.equal(trimmed.parents, full.parents[:b])
        # prefixes of the full numbering are closed: parents and elder siblings come first
        for siblings in kids:
            assert siblings == sorted(siblings)
        assert int(depths(full.parents).max()) <= 6


@pytest.mark.parametrize(
    "kwargs", [{"min_ngram": 0}, {"max_ngram": 1, "min_ngram": 2}, {"depth": 0}]
)
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        ngram_tree([1, 2, 1], **kwargs)


def test_fast_on_long_histories():
    gen = torch.Generator().manual_seed(1)
    history = torch.randint(0, 30, (8000,), generator=gen).tolist()
    start = time.perf_counter()
    for i in range(50):
        ngram_tree(history[: 7000 + i])
    assert (time.perf_counter() - start) / 50 < 0.02


def test_the_drafters_index_follows_each_sessions_history():
    """Its trees are prompt lookup over the session's history as the calls leave it: grown,
    a guess dropped and replaced (overlap), restarted, evicted and restarted, ended."""
    drafter = NgramDrafter(SessionTable(2))
    spec = TreeSpec(depth=3, budget=6)
    gen = torch.Generator().manual_seed(5)
    held = {"a": [], "b": [], "c": []}

    def propose(session: str, base: int, tokens: list[int]) -> None:
        (tree,) = drafter.propose([ProposeCall(session, base, tokens, spec)])
        if isinstance(tree, SessionLost):  # evicted: the caller re-sends the history
            base, tokens = 0, held[session][:base] + tokens
            (tree,) = drafter.propose([ProposeCall(session, 0, tokens, spec)])
        held[session] = held[session][:base] + tokens
        assert drafter.indexes[session].tokens == held[session]
        expected = ngram_tree(held[session], depth=3, budget=6)
        assert as_lists(tree) == as_lists(expected)

    for step in range(90):
        session = "c" if step % 9 == 8 else "ab"[step % 2]  # c evicts a or b now and then
        new = torch.randint(0, 5, (int(torch.randint(1, 6, ())),), generator=gen).tolist()
        base = len(held[session])
        if step % 5 == 4:
            base = max(0, base - 2)  # the last two tokens were a guess
        if step % 11 == 10:
            base, new = 0, held[session][:3] + new  # restarted from a history
        propose(session, base, new)
        assert len(drafter.indexes) <= 3
    drafter.end("a")
    assert "a" not in drafter.indexes
