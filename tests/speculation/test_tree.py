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
