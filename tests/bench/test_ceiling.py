"""The n-gram replay: accepted lengths and tau follow from the greedy text alone."""

import torch

from workers.speculation.ngram import ngram_tree
from workers.speculation.tree import TokenTree
from workers.tools.bench.ceiling import accepted, by_match, replay_tau


def test_accepted_follows_the_matching_branch():
    # 0: 5, 1: 6 (child of 0), 2: 7 (child of 0), 3: 8 (child of 2)
    tree = TokenTree(tokens=torch.tensor([5, 6, 7, 8]), parents=torch.tensor([-1, 0, 0, 2]))
    assert accepted(tree, [5, 7, 8, 9]) == 3
    assert accepted(tree, [5, 6, 1]) == 2
    assert accepted(tree, [4]) == 0
    assert accepted(TokenTree.empty(), [5]) == 0


def test_replay_tau_counts_the_bonus_token_and_stops_at_the_end():
    def no_draft(history):
        return TokenTree.empty()

    assert replay_tau([([1, 2], [3, 4, 5])], no_draft) == 1.0
    # the prompt ends where an earlier copy of the output begins: one round emits it all
    prompt, output = [1, 2, 3, 4, 5, 6, 7, 8, 1], [2, 3, 4, 5, 6, 7, 8]
    tau = replay_tau([(prompt, output)], lambda h: ngram_tree(h, depth=8, budget=8, chain=True))
    assert tau == 7.0


def test_by_match_counts_each_position_under_the_suffix_it_matched():
    # after "9 1" the 1-gram "1" matched, after "9 1 2" the 2-gram, after "1 2 3" the 3-gram
    counts = by_match([([1, 2, 3, 4, 5], [9, 1, 2, 3, 4])], depth=6)
    assert counts == [(2, 0, 0), (1, 1, 3), (1, 1, 2), (1, 1, 1)]
