"""Tree representation: derived structures on hand-built trees, and every malformation rejected."""

from __future__ import annotations

import pytest
import torch

from tests.speculation.helpers import random_tree
from workers.speculation import (
    TokenTree,
    TreeError,
    children,
    depths,
    leaf_paths,
    merge_trees,
    path_to,
    tree_mask,
    validate_tree,
)

#   root ─ 0 ─ 1 ─ 3
#        │   └ 2
#        └ 4 ─ 5
FOREST = torch.tensor([-1, 0, 0, 1, -1, 4])


def test_depths():
    assert depths(FOREST).tolist() == [1, 2, 2, 3, 1, 2]


def test_tree_mask():
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [0, 0, 0, 0, 1, 0],
            [0, 0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree_mask(FOREST), expected)


def ancestors(parents: list[int], i: int) -> list[int]:
    """i and its ancestors, walked up one parent at a time (the definition)."""
    chain = [i]
    while parents[chain[-1]] >= 0:
        chain.append(parents[chain[-1]])
    return chain


@pytest.mark.parametrize("n", [0, 1, 2, 17, 64, 130])
def test_depths_and_mask_follow_the_definition_on_random_forests_and_chains(n):
    gen = torch.Generator().manual_seed(n)
    chain = torch.arange(-1, n - 1)  # a prefill: every token the child of the one before
    for parents in (random_tree(n, 50, gen).parents, chain):
        listed = parents.tolist()
        expected = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            expected[i, ancestors(listed, i)] = True
        assert torch.equal(tree_mask(parents), expected)
        assert depths(parents).tolist() == [len(ancestors(listed, i)) for i in range(n)]


def test_children_paths_and_leaves():
    assert children(FOREST) == [[0, 4], [1, 2], [3], [], [], [5], []]
    assert path_to(FOREST, 3) == [0, 1, 3]
    assert path_to(FOREST, 4) == [4]
    assert leaf_paths(FOREST) == [[0, 1, 3], [0, 2], [4, 5]]


def test_empty_and_chain():
    empty = TokenTree.empty()
    assert len(empty) == 0
    assert depths(empty.parents).shape == (0,)
    assert tree_mask(empty.parents).shape == (0, 0)
    assert children(empty.parents) == [[]]
    assert leaf_paths(empty.parents) == []

    chain = TokenTree.chain([7, 8, 9])
    assert chain.parents.tolist() == [-1, 0, 1]
    assert chain.tokens.tolist() == [7, 8, 9]
    assert depths(chain.parents).tolist() == [1, 2, 3]
    assert torch.equal(tree_mask(chain.parents), torch.ones(3, 3, dtype=torch.bool).tril())
    assert leaf_paths(chain.parents) == [[0, 1, 2]]


def test_random_trees_are_consistent():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        n = int(torch.randint(1, 30, (), generator=gen))
        parents = random_tree(n, 10, gen).parents
        mask, depth = tree_mask(parents), depths(parents)
        for i in range(n):
            path = path_to(parents, i)
            assert mask[i].nonzero().flatten().tolist() == sorted(path)
            assert depth[i] == len(path)
        leaves = leaf_paths(parents)
        kids = children(parents)
        assert sorted(p[-1] for p in leaves) == [i for i in range(n) if not kids[i + 1]]
        assert leaves == sorted(leaves)  # lexicographic: elder siblings first


def _tree(tokens, parents, **q):
    return TokenTree(torch.tensor(tokens), torch.tensor(parents), **q)


@pytest.mark.parametrize(
    "parents, message",
    [
        ([-1, 0, -2], "node 2: parent -2 is out of range"),
        ([-1, 1, 0], "node 1: parent 1 is not an earlier node"),  # self-loop
        ([-1, 2, 1], "node 1: parent 2 is not an earlier node"),  # cycle 1 <-> 2
        ([0], "node 0: parent 0"),
    ],
)
def test_bad_parents_rejected(parents, message):
    with pytest.raises(TreeError, match=message):
        _tree([1] * len(parents), parents)
    with pytest.raises(TreeError, match=message):
        depths(torch.tensor(parents))


def test_bad_shapes_and_dtypes_rejected():
    with pytest.raises(TreeError, match="1-D LongTensor"):
        TokenTree(torch.tensor([1.0]), torch.tensor([-1]))
    with pytest.raises(TreeError, match="1-D LongTensor"):
        TokenTree(torch.tensor([1]), torch.tensor([-1], dtype=torch.int32))
    with pytest.raises(TreeError, match="parents has 2"):
        _tree([1], [-1, 0])
    with pytest.raises(TreeError, match="together"):
        _tree([1], [-1], q_tokens=torch.tensor([[1]]))
    with pytest.raises(TreeError, match="differ in shape"):
        _tree([1], [-1], q_tokens=torch.tensor([[1, 2]]), q_probs=torch.tensor([[1.0]]))
    with pytest.raises(TreeError, match="shape"):
        _tree([1], [-1], q_tokens=torch.tensor([[1], [2]]), q_probs=torch.tensor([[1.0], [0.0]]))
    assert TreeError.__mro__[1] is ValueError


def test_validate_tree():
    ok = _tree(
        [1, 2],
        [-1, -1],
        q_tokens=torch.tensor([[1, 2], [2, 0]]),
        q_probs=torch.tensor([[0.6, 0.4], [1.0, 0.0]]),
    )
    validate_tree(ok, vocab_size=3, max_nodes=2)
    with pytest.raises(TreeError, match="node 1: token 3 outside vocab"):
        validate_tree(_tree([0, 3], [-1, 0]), vocab_size=3)
    with pytest.raises(TreeError, match="node 0: token -1 outside vocab"):
        validate_tree(_tree([-1], [-1]), vocab_size=3)
    with pytest.raises(TreeError, match="3 nodes, over the budget of 2"):
        validate_tree(TokenTree.chain([0, 1, 2]), vocab_size=3, max_nodes=2)
    with pytest.raises(TreeError, match="node 1: q_probs sums to 0.900000"):
        validate_tree(
            _tree(
                [1, 2],
                [-1, 0],
                q_tokens=torch.tensor([[1, 2], [2, 0]]),
                q_probs=torch.tensor([[0.6, 0.4], [0.5, 0.4]]),
            ),
            vocab_size=3,
        )
    with pytest.raises(TreeError, match="node 0: its token 1 has probability 0"):
        validate_tree(
            _tree([1], [-1], q_tokens=torch.tensor([[1, 2]]), q_probs=torch.tensor([[0.0, 1.0]])),
            vocab_size=3,
        )
    with pytest.raises(TreeError, match="non-negative"):
        validate_tree(
            _tree([1], [-1], q_tokens=torch.tensor([[1, 2]]), q_probs=torch.tensor([[1.5, -0.5]])),
            vocab_size=3,
        )
    with pytest.raises(TreeError, match="q_tokens has an id outside vocab"):
        validate_tree(
            _tree([1], [-1], q_tokens=torch.tensor([[1, 9]]), q_probs=torch.tensor([[1.0, 0.0]])),
            vocab_size=3,
        )


# --- merging two drafts (a hybrid round) -------------------------------------------------

#   n-gram:  root ─ 0:a ─ 1:b ─ 2:c        model:  root ─ 0:a ─ 1:b ─ 3:e
#                                                       │     └ 2:d
#                                                       └ 4:f
A, B, C, D, E, F = 10, 11, 12, 13, 14, 15
NGRAM = TokenTree.chain([A, B, C])
MODEL = _tree([A, B, D, E, F], [-1, 0, 0, 1, -1])


def test_merge_deterministic_is_a_trie_union():
    merged = merge_trees(NGRAM, MODEL, budget=16)
    # the model's a and a-b are the n-gram's nodes 0 and 1; its new nodes follow in order
    assert merged.tokens.tolist() == [A, B, C, D, E, F]
    assert merged.parents.tolist() == [-1, 0, 1, 0, 1, -1]
    assert not merged.sampled
    validate_tree(merged, vocab_size=16)


def test_merge_cut_at_budget_keeps_parents():
    merged = merge_trees(NGRAM, MODEL, budget=4)
    assert merged.tokens.tolist() == [A, B, C, D]
    assert merged.parents.tolist() == [-1, 0, 1, 0]
    # the first tree alone over the budget: its topological prefix
    assert merge_trees(MODEL, NGRAM, budget=2).tokens.tolist() == [A, B]
    # a node of the second tree whose parent was cut is cut too
    deep = _tree([F, A], [-1, 0])
    merged = merge_trees(TokenTree.chain([B, C]), deep, budget=2)
    assert merged.tokens.tolist() == [B, C]


def test_merge_with_an_empty_tree():
    assert merge_trees(TokenTree.empty(), NGRAM, budget=8).tokens.tolist() == [A, B, C]
    assert merge_trees(NGRAM, TokenTree.empty(), budget=8).parents.tolist() == [-1, 0, 1]
    assert len(merge_trees(TokenTree.empty(), TokenTree.empty(), budget=8)) == 0


def test_merge_sampled_is_a_forest_with_one_hot_rows():
    q_tokens = torch.tensor([[A, D, E], [B, C, F], [D, F, E], [E, A, B], [F, A, B]])  # (5, 3)
    q_probs = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.4, 0.0], [0.5, 0.5, 0.0],
                            [1.0, 0.0, 0.0], [0.7, 0.2, 0.1]])  # fmt: skip
    sampled = _tree([A, B, D, E, F], [-1, 0, 0, 1, -1], q_tokens=q_tokens, q_probs=q_probs)
    merged = merge_trees(NGRAM, sampled, budget=7)
    # no de-duplication: the model's a is a second root after the n-gram's chain
    assert merged.tokens.tolist() == [A, B, C, A, B, D, E]
    assert merged.parents.tolist() == [-1, 0, 1, -1, 3, 3, 4]
    assert merged.q_tokens.shape == (7, 3)
    assert merged.q_tokens[:3].tolist() == [[A, A, A], [B, B, B], [C, C, C]]
    assert merged.q_probs[:3].tolist() == [[1.0, 0.0, 0.0]] * 3
    assert torch.equal(merged.q_tokens[3:], q_tokens[:4])
    assert torch.equal(merged.q_probs[3:], q_probs[:4])
    validate_tree(merged, vocab_size=16)
    # the other way round, the deterministic rows come second, still padded to K
    merged = merge_trees(sampled, NGRAM, budget=16)
    assert merged.parents.tolist() == [-1, 0, 0, 1, -1, -1, 5, 6]
    assert merged.q_probs[5:].tolist() == [[1.0, 0.0, 0.0]] * 3
    validate_tree(merged, vocab_size=16)
