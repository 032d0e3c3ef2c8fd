"""Prompt-lookup trees: matching, merging, ordering, budget and closure."""

from __future__ import annotations

import time

import pytest
import torch

from workers.speculation import children, depths, ngram_tree
from workers.speculation.ngram import SuffixIndex, match_length


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


@pytest.mark.parametrize("vocab,window", [(2, 4096), (3, 5), (5, 30), (20, 2)])
def test_the_suffix_index_gives_the_match_length_as_the_history_grows(vocab, window):
    gen = torch.Generator().manual_seed(vocab)
    history: list[int] = []
    index = SuffixIndex(window=window)
    assert index.match_length() == 0
    for _ in range(150):
        new = torch.randint(0, vocab, (int(torch.randint(1, 4, ())),), generator=gen).tolist()
        history += new
        index.extend(new)
        assert len(index) == len(history)
        for most in (1, 2, 3):
            for least in range(1, most + 1):
                expected = match_length(history, most, least, window)
                assert index.match_length(most, least) == expected


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
