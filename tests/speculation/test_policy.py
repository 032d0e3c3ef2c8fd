"""choose_children, TreeBuilder (closure, budget, renumbering) and the two tree policies."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from tests.speculation.helpers import run_policy
from workers.speculation import (
    DEFAULT_TREE,
    DynamicTreePolicy,
    SamplingParams,
    StaticTreePolicy,
    TreeBuilder,
    children,
    choose_children,
    make_generator,
    validate_tree,
)

SAMPLED = SamplingParams(temperature=1.0)


def test_choose_children_greedy_is_top_k():
    probs = torch.tensor([0.1, 0.5, 0.0, 0.3, 0.1])
    toks, q_toks, q_probs, logps = choose_children(probs, 3, True)
    assert toks.tolist() == [1, 3, 0] or toks.tolist() == [1, 3, 4]
    assert q_toks is None and q_probs is None
    torch.testing.assert_close(logps, probs[toks].log())
    toks, *_ = choose_children(probs, 9, SamplingParams())  # greedy params; zeros dropped
    assert sorted(toks.tolist()) == [0, 1, 3, 4]


def test_choose_children_sampled_rows_are_conditionals():
    probs = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    toks, q_toks, q_probs, logps = choose_children(probs, 3, SAMPLED, make_generator(0), top_k=4)
    assert q_toks is not None and q_probs is not None
    assert toks.shape == (3,) and q_toks.shape == (3, 4) and q_probs.shape == (3, 4)
    assert len(set(toks.tolist())) == 3  # without replacement
    assert sorted(q_toks[0].tolist()) == [1, 2, 3, 4]  # top-4 support, token 0 truncated
    truncated = probs[q_toks[0]] / probs[q_toks[0]].sum()  # (K,)
    for i in range(3):
        expected = truncated.clone()
        for elder in toks[:i].tolist():
            expected[q_toks[0] == elder] = 0
        torch.testing.assert_close(q_probs[i], expected / expected.sum())
        assert q_probs[i][q_toks[i] == toks[i]].item() > 0
    torch.testing.assert_close(logps, probs[toks].log())


def test_choose_children_sampled_draws_match_sequential_without_replacement():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    gen = make_generator(1)
    counts = torch.zeros(4, 4)
    rounds = 6000
    for _ in range(rounds):
        toks, *_ = choose_children(probs, 2, SAMPLED, gen)
        counts[toks[0], toks[1]] += 1
    expected = probs[:, None] * probs[None, :] / (1 - probs[:, None])  # (4, 4) P(a then b)
    expected.fill_diagonal_(0)
    keep = expected > 0
    p = chisquare(counts[keep].numpy(), (expected[keep] * rounds).numpy()).pvalue
    assert counts.diagonal().sum() == 0 and p > 1e-3


def test_choose_children_returns_fewer_when_mass_runs_out():
    probs = torch.tensor([0.0, 0.7, 0.0, 0.3])
    toks, q_toks, q_probs, logps = choose_children(probs, 3, SAMPLED, make_generator(2))
    assert sorted(toks.tolist()) == [1, 3] and q_probs.shape[0] == 2 and logps.shape == (2,)
    with pytest.raises(ValueError, match="generator"):
        choose_children(probs, 2, SAMPLED)
    with pytest.raises(ValueError):
        choose_children(probs, 0, True)


def test_builder_bookkeeping_and_errors():
    b = TreeBuilder()
    a = b.add(-1, 5, math.log(0.5))
    c = b.add(a, 6, math.log(0.5))
    d = b.add(a, 7, math.log(0.25))
    assert (a, c, d) == (0, 1, 2) and len(b) == 3
    assert b.depth(d) == 2 and b.token(d) == 7
    assert b.cum_logp(d) == pytest.approx(math.log(0.125))
    assert b.rank_path(d) == (0, 1) and b.children_of(a) == [1, 2]
    assert b.level(2) == [1, 2] and b.best(b.level(2), 1) == [1]
    with pytest.raises(ValueError, match="parent 3"):
        b.add(3, 1, -1.0)
    with pytest.raises(ValueError, match="log-probability"):
        b.add(-1, 1, 0.5)
    with pytest.raises(ValueError, match="every node"):
        b.add(-1, 1, -1.0, torch.tensor([1]), torch.tensor([1.0]))


def _random_builder(gen: torch.Generator, n: int, sampled: bool) -> TreeBuilder:
    """Random builder whose node i has token i, and (sampled) a q row tagged with i."""
    b = TreeBuilder()
    for i in range(n):
        parent = int(torch.randint(-1, i, (), generator=gen))
        logp = float(torch.rand((), generator=gen).clamp(min=1e-3).log())
        if sampled:
            width = 1 + i % 3  # ragged rows get padded by build
            q_toks = torch.full((width,), i)
            q_probs = torch.full((width,), 1.0 / width)
            b.add(parent, i, logp, q_toks, q_probs)
        else:
            b.add(parent, i, logp)
    return b


@pytest.mark.parametrize("sampled", [False, True], ids=["deterministic", "sampled"])
def test_build_keeps_a_closed_renumbered_set(sampled: bool):
    gen = torch.Generator().manual_seed(0)
    for _ in range(60):
        n = int(torch.randint(1, 25, (), generator=gen))
        builder = _random_builder(gen, n, sampled)
        budget = int(torch.randint(0, n + 3, (), generator=gen))
        tree = builder.build(budget)
        validate_tree(tree, vocab_size=n, max_nodes=budget)
        kept = tree.tokens.tolist()  # token == original index
        assert kept == sorted(kept)  # original order kept
        assert len(kept) == min(n, budget)  # the closure greedy fills the budget exactly
        for new, old in enumerate(kept):
            parent = tree.parents[new].item()
            old_parent = builder._parents[old]
            assert (parent == -1) if old_parent < 0 else (kept[parent] == old_parent)
            siblings = builder.children_of(old_parent)
            assert all(s in kept for s in siblings[: siblings.index(old)])  # elders kept
            if sampled:
                assert tree.q_tokens is not None and tree.q_probs is not None
                row = tree.q_probs[new] > 0
                assert (tree.q_tokens[new][row] == old).all()  # its own row travelled with it
                assert int(row.sum()) == 1 + old % 3


def test_deterministic_build_is_eagle2_top_by_cumulative_logp():
    b = TreeBuilder()
    r0 = b.add(-1, 0, math.log(0.6))
    r1 = b.add(-1, 1, math.log(0.3))
    b.add(r0, 2, math.log(0.9))  # cum 0.54
    b.add(r0, 3, math.log(0.1))  # cum 0.06
    b.add(r1, 4, math.log(0.5))  # cum 0.15
    assert b.build(4).tokens.tolist() == [0, 1, 2, 4]


def test_sampled_score_ignores_the_nodes_own_token():
    def builder(first_logp: float) -> TreeBuilder:
        b = TreeBuilder()
        q = (torch.tensor([0, 1]), torch.tensor([0.5, 0.5]))
        b.add(-1, 0, first_logp, *q)
        b.add(-1, 1, math.log(0.2), *q)
        return b

    high, low = builder(math.log(0.7)), builder(math.log(0.1))
    assert high.score(0) == low.score(0) == 0.0  # the root's eldest is always tried
    assert high.score(1) == pytest.approx(math.log(0.3))  # tried iff the elder is rejected
    assert low.score(1) == pytest.approx(math.log(0.9))


def test_static_policy_expands_exactly_its_shape():
    vocab = 12
    flat = torch.full((vocab,), 1.0 / vocab)  # every child available, no zero-prob cut-off

    def next_probs(prev: int) -> torch.Tensor:
        return flat

    for policy in [StaticTreePolicy.default(), StaticTreePolicy.chain(4)]:
        for params, gen in [(True, None), (SAMPLED, make_generator(0))]:
            builder, tree = run_policy(policy, next_probs, 0, params, gen)
            assert len(tree) == len(builder) == policy.max_nodes
            assert {builder.rank_path(i) for i in range(len(builder))} == set(policy.paths)
    assert len(DEFAULT_TREE) == 16 and StaticTreePolicy.default().depth == 5
    assert StaticTreePolicy.chain(3).paths == ((0,), (0, 0), (0, 0, 0))


def test_static_policy_plan():
    policy = StaticTreePolicy([(0,), (1,), (0, 0), (0, 1), (0, 2), (1, 0), (0, 0, 0)])
    b = TreeBuilder()
    assert policy.expand_plan(b, 0) == {-1: 2}
    first, second = b.add(-1, 3, -0.1), b.add(-1, 4, -0.2)
    assert policy.expand_plan(b, 1) == {first: 3, second: 1}
    grand = [b.add(first, t, -0.1) for t in range(3)] + [b.add(second, 9, -0.1)]
    assert policy.expand_plan(b, 2) == {grand[0]: 1}
    assert policy.expand_plan(b, 3) == {}


@pytest.mark.parametrize(
    "paths, message",
    [
        ([(0,), (0, 1)], "no elder sibling"),
        ([(1,)], "no elder sibling"),
        ([(0, 0)], "no parent path"),
        ([(0,), (0,)], "duplicates"),
        ([()], "non-empty"),
        ([], "at least one"),
    ],
)
def test_static_policy_rejects_open_shapes(paths, message):
    with pytest.raises(ValueError, match=message):
        StaticTreePolicy(paths)


def test_dynamic_policy_expands_best_frontier_and_trims():
    policy = DynamicTreePolicy(depth=3, branching=2, budget=5)
    b = TreeBuilder()
    assert policy.expand_plan(b, 0) == {-1: 2}
    x = b.add(-1, 0, math.log(0.3))
    y = b.add(-1, 1, math.log(0.6))
    assert policy.expand_plan(b, 1) == {y: 2, x: 2}  # best first
    kids = [b.add(y, 2, math.log(0.5)), b.add(y, 3, math.log(0.4))]
    kids += [b.add(x, 4, math.log(0.9)), b.add(x, 5, math.log(0.05))]
    # cumulative: 0.3, 0.24, 0.27, 0.015 -> the two best at depth 2 are y's first and x's first
    assert policy.expand_plan(b, 2) == {kids[0]: 2, kids[2]: 2}
    tree = policy.build(b)
    assert len(tree) == 5
    assert children(tree.parents)[0] == [0, 1]
    with pytest.raises(ValueError):
        DynamicTreePolicy(depth=0, branching=2, budget=4)


def test_dynamic_policy_sampled_trees_are_valid():
    gen = make_generator(5)
    logits = torch.randn(6, 6, generator=torch.Generator().manual_seed(5))
    probs = torch.softmax(logits, dim=-1)  # (V, V) Markov draft
    policy = DynamicTreePolicy(depth=4, branching=3, budget=10)
    for _ in range(30):
        builder, tree = run_policy(policy, lambda prev: probs[prev], 0, SAMPLED, gen)
        validate_tree(tree, vocab_size=6, max_nodes=10)
        assert len(tree) == min(10, len(builder))
