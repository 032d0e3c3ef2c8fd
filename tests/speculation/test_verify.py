"""Greedy verification against brute force; stochastic verification's edge cases; lossy rules."""

from __future__ import annotations

import pytest
import torch

from tests.speculation.helpers import random_tree
from workers.speculation import (
    SamplingParams,
    TokenTree,
    TreeError,
    Verdict,
    greedy_verify,
    make_generator,
    path_to,
    stochastic_verify,
    verify,
)
from workers.speculation.acceptance import AcceptanceRule


def brute_force_greedy(tree: TokenTree, logits: torch.Tensor) -> Verdict:
    """Enumerate every root-to-node path; keep the longest fully matching one, elder first."""
    best = logits.argmax(dim=-1).tolist()
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    matching: list[list[int]] = [[]]
    for i in range(len(tree)):
        path = path_to(tree.parents, i)
        if all(tokens[j] == best[parents[j] + 1] for j in path):
            matching.append(path)
    chosen = min(matching, key=lambda p: (-len(p), p))
    return Verdict(accepted=chosen, bonus=best[chosen[-1] + 1 if chosen else 0])


def test_greedy_verify_matches_brute_force():
    gen = torch.Generator().manual_seed(0)
    longest = 0
    for trial in range(300):
        n = int(torch.randint(0, 25, (), generator=gen))
        vocab = 2 + trial % 3  # tiny vocabularies: many matches, identical-token siblings
        tree = random_tree(n, vocab, gen)
        logits = torch.randn(n + 1, vocab, generator=gen)  # (N+1, V)
        got = greedy_verify(tree, logits)
        assert got == brute_force_greedy(tree, logits)
        longest = max(longest, len(got.accepted))
    assert longest >= 4  # the trials did exercise deep acceptance


def test_greedy_verify_prefers_elder_sibling_path_on_ties():
    # root -> 0 (tok 1) and 1 (tok 1); 2 under 1, 3 under 0; both grandchildren match
    tree = TokenTree(torch.tensor([1, 1, 2, 2]), torch.tensor([-1, -1, 1, 0]))
    logits = torch.zeros(5, 3)
    logits[:, 2] = 1.0
    logits[0] = torch.tensor([0.0, 5.0, 0.0])  # argmax after the root: 1
    assert greedy_verify(tree, logits) == Verdict(accepted=[0, 3], bonus=2)


def test_greedy_verify_empty_tree_and_shapes():
    assert greedy_verify(TokenTree.empty(), torch.tensor([[0.0, 3.0, 1.0]])) == Verdict([], 1)
    with pytest.raises(ValueError, match="N\\+1=3"):
        greedy_verify(TokenTree.chain([0, 1]), torch.zeros(2, 4))
    with pytest.raises(TreeError, match="outside vocab"):
        greedy_verify(TokenTree.chain([0, 9]), torch.zeros(3, 4))


def test_stochastic_at_temperature_zero_equals_greedy():
    gen = torch.Generator().manual_seed(1)
    rng = make_generator(1)
    for _ in range(100):
        n = int(torch.randint(0, 12, (), generator=gen))
        tree = random_tree(n, 16, gen, unique_siblings=True)
        logits = torch.randn(n + 1, 16, generator=gen)
        logits[:, :4] += 3  # make the argmax a likely draft token
        got = stochastic_verify(tree, logits, SamplingParams(temperature=0.0), rng)
        assert got == greedy_verify(tree, logits)


def test_one_hot_rejection_never_reemits_a_rejected_token():
    # target puts mass on 0, 1, 2; the root's drafts are 0 and 1: a bonus after rejecting
    # both must be 2
    tree = TokenTree(torch.tensor([0, 1]), torch.tensor([-1, -1]))
    logits = torch.log(torch.tensor([[0.45, 0.45, 0.1], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]))
    params = SamplingParams(temperature=1.0)
    rng = make_generator(2)
    outcomes = [stochastic_verify(tree, logits, params, rng) for _ in range(300)]
    assert all(v.bonus == 2 for v in outcomes if not v.accepted)
    assert any(not v.accepted for v in outcomes) and any(v.accepted for v in outcomes)


def test_draft_equal_to_target_always_accepts_and_never_nans():
    # q == p exactly: acceptance prob 1, and a residual of zero must not produce NaN
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    tree = TokenTree(
        torch.tensor([0, 1]),
        torch.tensor([-1, 0]),
        q_tokens=torch.tensor([[0, 1, 2], [1, 0, 2]]),
        q_probs=torch.tensor([[0.5, 0.3, 0.2], [0.3, 0.5, 0.2]]),
    )
    logits = probs.log().expand(3, 4)  # (N+1, V) the same distribution everywhere
    rng = make_generator(3)
    for _ in range(200):
        v = stochastic_verify(tree, logits, SamplingParams(temperature=1.0), rng)
        assert v.accepted == [0, 1] and v.bonus in (0, 1, 2)


def test_residual_fallback_is_finite():
    from importlib import import_module

    residual = import_module("workers.speculation.verify")._residual
    p = torch.tensor([0.7, 0.3, 0.0])
    out = residual(p, p.clone(), rejected=[0])  # max(0, p - q) == 0
    assert torch.equal(out, torch.tensor([0.0, 1.0, 0.0]))
    out = residual(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]), rejected=[0])
    assert torch.isfinite(out).all() and out.sum() == 1


def test_draft_token_outside_target_support_is_rejected():
    logits = torch.tensor([[2.0, 1.0, 0.0, 5.0], [0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=1.0, top_k=2)  # token 3 survives, 2 does not
    rng = make_generator(4)
    bonus_tokens = set()
    for _ in range(200):
        v = stochastic_verify(TokenTree.chain([2]), logits, params, rng)
        assert v.accepted == []
        bonus_tokens.add(v.bonus)
    assert bonus_tokens == {0, 3}


def test_verify_dispatch():
    tree = TokenTree.chain([1, 2])
    logits = torch.tensor([[0.0, 9.0, 0.0], [0.0, 0.0, 9.0], [9.0, 0.0, 0.0]])
    assert verify(tree, logits, SamplingParams()) == Verdict([0, 1], 0)
    v = verify(tree, logits, SamplingParams(temperature=1.0), make_generator(0))
    assert v.accepted[: len(v.accepted)] == [0, 1][: len(v.accepted)]
    with pytest.raises(ValueError, match="generator"):
        verify(tree, logits, SamplingParams(temperature=1.0))


def test_exact_rule_is_plain_verification():
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        tree = random_tree(12, 5, gen)
        logits = torch.randn(len(tree) + 1, 5, generator=gen)
        assert verify(tree, logits, SamplingParams(), rule=AcceptanceRule()) == greedy_verify(
            tree, logits
        )


def lossy(kind: str, **kw) -> AcceptanceRule:
    return AcceptanceRule(kind, **kw)


# after the root: p = (0.5, 0.3, 0.2); after node 0: p = (0.1, 0.1, 0.8); after node 1: uniform
PROBS = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [1 / 3, 1 / 3, 1 / 3]])
LOGITS = PROBS.log()  # (3, 3): softmax at temperature 1 gives PROBS back


@pytest.mark.parametrize(
    "rule, accepted",
    [
        (lossy("threshold", threshold=0.31), []),  # 0.3 < 0.31: token 1 is not the argmax 0
        (lossy("threshold", threshold=0.3), [0]),  # then 0.1 < 0.3: token 0 is rejected
        (lossy("threshold", threshold=0.1), [0, 1]),  # both at least 0.1
        # typical: bar = min(epsilon, delta * exp(-H)); exp(-H) = 0.357 at the root, 0.528 after
        (lossy("typical", epsilon=0.5, delta=0.9), []),  # root bar 0.321 > 0.3
        (lossy("typical", epsilon=0.2, delta=0.5), [0]),  # bars 0.178, then 0.2 > 0.1
        (lossy("typical", epsilon=0.09, delta=0.3), [0, 1]),  # bars 0.09 and 0.09
    ],
)
def test_lossy_rules_accept_likely_tokens_greedy(rule, accepted):
    tree = TokenTree.chain([1, 0])  # node 0 = token 1 after the root, node 1 = token 0
    verdict = verify(tree, LOGITS, SamplingParams(), rule=rule)
    assert verdict.accepted == accepted
    assert verdict.bonus == int(LOGITS[accepted[-1] + 1 if accepted else 0].argmax())


def test_typical_bar_by_hand():
    entropy = float(-(PROBS[0] * PROBS[0].log()).sum())
    bar = min(0.5, 0.9 * torch.exp(torch.tensor(-entropy)).item())
    assert 0.3 < bar < 0.33  # so token 1 (p 0.3) is rejected at the root, as a case above says


def test_lossy_always_accepts_the_argmax_and_takes_the_longest_path():
    # two branches: node 0 (token 2, p 0.2) -> node 2; node 1 (token 0, the argmax) alone
    tree = TokenTree(torch.tensor([2, 0, 2]), torch.tensor([-1, -1, 0]))
    logits = torch.tensor([[5.0, 0.0, 4.0], [0.0, 0.0, 5.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    strict = verify(tree, logits, SamplingParams(), rule=lossy("threshold", threshold=0.9))
    assert strict.accepted == [1]  # the argmax passes any threshold
    loose = verify(tree, logits, SamplingParams(), rule=lossy("threshold", threshold=0.2))
    assert loose.accepted == [0, 2]  # both of node 0's path are likely enough: the longer


def test_lossy_sampling_needs_a_generator_and_draws_the_bonus_from_p():
    tree = TokenTree.chain([1])
    params = SamplingParams(temperature=1.0)
    with pytest.raises(ValueError, match="generator"):
        verify(tree, LOGITS[:2], params, rule=lossy("threshold", threshold=0.2))
    bonuses = {
        verify(tree, LOGITS[:2], params, make_generator(s), lossy("threshold", threshold=0.2)).bonus
        for s in range(40)
    }
    assert bonuses == {0, 1, 2}  # drawn from (0.1, 0.1, 0.8), not its argmax


def test_acceptance_rule_checks_its_values():
    with pytest.raises(ValueError):
        AcceptanceRule("median")
    with pytest.raises(ValueError):
        AcceptanceRule("threshold", threshold=0.0)
    assert AcceptanceRule().lossless and not lossy("typical").lossless
