"""Prompt-lookup trees ranked by reach probability; the chain form."""

from __future__ import annotations

from workers.speculation import ngram_tree


def test_chain_is_the_best_path_of_the_tree():
    # suffix (1, 2) occurs three times before: followed by 3 4 5 | 3 9 9 | 7 7 7 (oldest first)
    history = [1, 2, 3, 4, 5, 0, 1, 2, 3, 9, 9, 0, 1, 2, 7, 7, 7, 0, 1, 2]
    tree = ngram_tree(history, max_ngram=2, depth=3, budget=16)
    chain = ngram_tree(history, max_ngram=2, depth=3, budget=16, chain=True)
    # 3 carries two of the three votes; below it the more recent 9 9 wins
    assert chain.tokens.tolist() == [3, 9, 9]
    assert chain.parents.tolist() == [-1, 0, 1]
    assert tree.tokens.tolist()[0] == 3 and len(tree) > len(chain)
    assert ngram_tree(history, max_ngram=2, depth=3, budget=2, chain=True).tokens.tolist() == [3, 9]


def test_an_early_alternative_outranks_the_deep_end_of_the_spine():
    # the most recent match runs 8 tokens deep; an older one diverges at once
    history = [1, 2, 50, 0, 9, 1, 2, 10, 11, 12, 13, 14, 15, 16, 17, 9, 1, 2]
    tree = ngram_tree(history, max_ngram=2, depth=8, budget=5)
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    assert 50 in tokens and parents[tokens.index(50)] == -1  # the alternative made the cut
    assert 17 not in tokens  # the spine's deepest token did not
