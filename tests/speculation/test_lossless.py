"""Speculative sampling over a tree must reproduce the target's distribution exactly.

The "models" are Markov chains on a 5-token vocabulary: the target's
next-token logits are a fixed random table indexed by the previous token, and
the draft is a deliberately poor perturbation of it. From one fixed context we
run many independent rounds (draft a tree, verify it) and look at the first two
emitted tokens. A round emits its accepted path plus a bonus token, so 1 to 3
tokens; when it emits only one, the second is drawn from the target after it,
exactly what the next round's target would do. By losslessness the pair is
then distributed as the target's own two-token distribution
P(a | root) * P(b | a), which a chi-square test compares against.

The power tests break the algorithm on purpose and require the same test to
reject it decisively. One of them is a trap worth knowing: EAGLE-2's rerank
(keep the nodes with the highest own cumulative log-prob) is lossy for
*sampled* trees even when the kept set is closed under ancestors and elder
siblings; TreeBuilder.build ranks sampled nodes without their own token.
"""

from __future__ import annotations

import functools
import importlib

import pytest
import torch
from scipy.stats import chisquare

from tests.speculation.helpers import run_policy
from workers.speculation import (
    DynamicTreePolicy,
    SamplingParams,
    StaticTreePolicy,
    TokenTree,
    TreeBuilder,
    TreePolicy,
    make_generator,
    merge_trees,
    ngram_tree,
    sample,
    stochastic_verify,
    target_probs,
)

# the package re-exports the function `verify`, which shadows the submodule's attribute
verify_module = importlib.import_module("workers.speculation.verify")
tree_module = importlib.import_module("workers.speculation.tree")

V = 5  # vocabulary
ROOT = 2  # the last committed token

_g = torch.Generator().manual_seed(1234)
TARGET = torch.randn(V, V, generator=_g) * 1.5  # (V, V) target logits after each token
DRAFT = 0.3 * TARGET + torch.randn(V, V, generator=_g)  # (V, V) a poor draft's logits


def target_pairs(params: SamplingParams) -> torch.Tensor:
    """Exact target distribution of the next two tokens, flattened (V*V,) as a*V + b."""
    first = target_probs(TARGET[ROOT], params).double()  # (V,)
    second = target_probs(TARGET, params).double()  # (V, V) row a: after token a
    joint = first[:, None] * second  # (V, V)
    return (joint / joint.sum()).reshape(-1)  # (V*V,)


@functools.cache
def draft_probs(temperature: float) -> torch.Tensor:
    """The draft's next-token probabilities after each token, (V, V), once per temperature."""
    return target_probs(DRAFT, SamplingParams(temperature=temperature))


def draft_tree(policy: TreePolicy, params: SamplingParams, gen: torch.Generator) -> TokenTree:
    """One round of drafting through the engine loop, children sampled without replacement."""
    probs = draft_probs(params.temperature)  # (V, V)
    return run_policy(policy, lambda prev: probs[prev], ROOT, params, gen)[1]


def first_pair(tree: TokenTree, params: SamplingParams, gen: torch.Generator) -> int:
    """Verify one tree against the target; return the first two emitted tokens as a*V + b."""
    context = torch.cat([torch.tensor([ROOT]), tree.tokens])  # (N+1,) token before each row
    verdict = stochastic_verify(tree, TARGET[context], params, gen)
    emitted = [int(tree.tokens[i]) for i in verdict.accepted] + [verdict.bonus]
    if len(emitted) == 1:  # continue as plain target sampling would
        emitted.append(sample(target_probs(TARGET[emitted[0]], params), gen))
    return emitted[0] * V + emitted[1]


def chi_square_p(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """p-value of counts (C,) against probabilities (C,); cells with expected < 5 pooled.

    Also asserts that no count falls where the target has probability 0.
    """
    n = int(counts.sum())
    support = expected_probs > 0  # (C,)
    assert int(counts[~support].sum()) == 0, "emitted a pair the target cannot produce"
    obs, exp = counts[support].double(), expected_probs[support] * n  # (C',), (C',)
    small = exp < 5  # (C',)
    if small.any():
        obs = torch.cat([obs[~small], obs[small].sum(dim=0, keepdim=True)])
        exp = torch.cat([exp[~small], exp[small].sum(dim=0, keepdim=True)])
    return float(chisquare(obs.numpy(), exp.numpy() * (obs.sum() / exp.sum()).item()).pvalue)


def run_rounds(
    make_tree, params: SamplingParams, rounds: int, seed: int = 0
) -> tuple[torch.Tensor, float]:
    """Counts of the first emitted pair over independent rounds, and the chi-square p."""
    gen = make_generator(seed)
    counts = torch.zeros(V * V, dtype=torch.long)  # (V*V,)
    for _ in range(rounds):
        tree = make_tree(gen)
        counts[first_pair(tree, params, gen)] += 1
    return counts, chi_square_p(counts, target_pairs(params))


# children drawn without replacement; static: branching up to 3, depth 2
SMALL_STATIC = StaticTreePolicy([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)])
# dynamic: which depth-2 nodes get children depends on their sampled tokens, and
# build() trims up to 10 nodes to 3
SMALL_DYNAMIC = DynamicTreePolicy(depth=3, branching=2, budget=3)
PARAMS = SamplingParams(temperature=0.8)

SAMPLED_CASES = [
    pytest.param(SMALL_STATIC, PARAMS, 20_000, id="static-t0.8"),
    pytest.param(SMALL_DYNAMIC, SamplingParams(temperature=1.0, top_k=3), 6_000, id="dynamic-k3"),
    pytest.param(SMALL_STATIC, SamplingParams(temperature=0.7, top_p=0.8), 4_000, id="static-p0.8"),
]


@pytest.mark.parametrize("policy, params, rounds", SAMPLED_CASES)
def test_sampled_tree_is_lossless(policy: TreePolicy, params: SamplingParams, rounds: int):
    _, p = run_rounds(lambda gen: draft_tree(policy, params, gen), params, rounds)
    assert p > 1e-3, f"speculative pairs differ from the target (chi-square p={p:.2e})"


def _deterministic_trees() -> list[TokenTree]:
    history = [0, 2, 1, 3, 2, 1, 4, 2, 3, 0, 2, 1, 3, 4, 2]  # ends at ROOT
    lookup = ngram_tree(history, max_ngram=2, depth=3, budget=8)
    duplicates = TokenTree(  # identical-token siblings, a deep chain and a forest
        tokens=torch.tensor([1, 1, 3, 0, 4, 4, 2]),
        parents=torch.tensor([-1, -1, -1, 0, 1, 3, 4]),
    )
    return [lookup, duplicates]


@pytest.mark.parametrize("tree", _deterministic_trees(), ids=["ngram", "duplicates"])
def test_deterministic_candidates_are_lossless(tree: TokenTree):
    assert len(tree) > 0
    params = SamplingParams(temperature=0.9)
    _, p = run_rounds(lambda gen: tree, params, 4_000, seed=1)
    assert p > 1e-3, f"speculative pairs differ from the target (chi-square p={p:.2e})"


def test_greedy_draft_reranked_by_own_logp_is_lossless():
    # deterministic candidates: EAGLE-2's own-token rerank is fine, the one-hot rule is
    # exact for any candidate set
    policy = SMALL_DYNAMIC
    params = SamplingParams(temperature=1.0)
    draft_probs = target_probs(DRAFT, params)  # (V, V)

    def make_tree(gen: torch.Generator) -> TokenTree:
        return run_policy(policy, lambda prev: draft_probs[prev], ROOT, True)[1]

    _, p = run_rounds(make_tree, params, 4_000, seed=2)
    assert p > 1e-3, f"speculative pairs differ from the target (chi-square p={p:.2e})"


# Power: each variant below is lossy; the same test must reject it decisively.


def test_power_skipping_the_residual_is_caught(monkeypatch: pytest.MonkeyPatch):
    # after a rejection the next sibling is judged against p, not max(0, p - q)
    monkeypatch.setattr(verify_module, "_residual", lambda p, q, rejected: p)
    _, p = run_rounds(lambda gen: draft_tree(SMALL_STATIC, PARAMS, gen), PARAMS, 3_000)
    assert p < 1e-6, f"the chi-square test missed a lossy verifier (p={p:.2e})"


def test_power_skipping_the_residual_is_caught_for_deterministic_candidates(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setattr(verify_module, "_residual", lambda p, q, rejected: p)
    tree = _deterministic_trees()[1]
    params = SamplingParams(temperature=0.9)
    _, p = run_rounds(lambda gen: tree, params, 2_000, seed=1)
    assert p < 1e-6, f"the chi-square test missed a lossy verifier (p={p:.2e})"


def test_power_sampled_rerank_by_own_logp_is_caught(monkeypatch: pytest.MonkeyPatch):
    # EAGLE-2's rerank score (a node's own cumulative log-prob) applied to a sampled
    # tree: whether a node is kept then depends on its token, so kept tokens are no
    # longer draws from their q rows
    monkeypatch.setattr(TreeBuilder, "score", lambda self, i: self.cum_logp(i))
    params = SamplingParams(temperature=1.0, top_k=3)
    _, p = run_rounds(lambda gen: draft_tree(SMALL_DYNAMIC, params, gen), params, 6_000)
    assert p < 1e-6, f"the chi-square test missed a lossy rerank (p={p:.2e})"


# Hybrid rounds: a deterministic n-gram chain merged with a sampled model tree. The chain
# starts with the draft's likeliest token after ROOT, so the model often draws it again.


HYBRID_PARAMS = SamplingParams(temperature=0.7)  # the likeliest draft token: q = 0.67


def _hybrid_parts(params: SamplingParams, gen: torch.Generator) -> tuple[TokenTree, TokenTree]:
    likeliest = int(DRAFT[ROOT].argmax())
    then = int(TARGET[likeliest].argmin())  # a continuation the target rarely takes
    lookup = ngram_tree([ROOT, likeliest, then, ROOT], depth=2, budget=2)  # (2,) chain
    assert lookup.tokens.tolist() == [likeliest, then]
    return lookup, draft_tree(SMALL_STATIC, params, gen)


def test_hybrid_tree_is_lossless():
    def make_tree(gen: torch.Generator) -> TokenTree:
        return merge_trees(*_hybrid_parts(HYBRID_PARAMS, gen), budget=8)

    _, p = run_rounds(make_tree, HYBRID_PARAMS, 3_000)
    assert p > 1e-3, f"speculative pairs differ from the target (chi-square p={p:.2e})"


def test_power_deduplicating_a_sampled_hybrid_is_caught():
    # the trie union applied to a sampled tree: a model child equal to the n-gram's is
    # merged into it, so the model's later siblings no longer follow their recorded rows
    def make_tree(gen: torch.Generator) -> TokenTree:
        return tree_module._union(*_hybrid_parts(HYBRID_PARAMS, gen), 8, dedupe=True)

    _, p = run_rounds(make_tree, HYBRID_PARAMS, 2_000)
    assert p < 1e-6, f"the chi-square test missed a lossy merge (p={p:.2e})"
