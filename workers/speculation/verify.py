"""Verification: which draft nodes the target accepts, and the token it adds.

Terms (as in vLLM's rejection sampler): an *accepted* token is a draft node the
target keeps; the *bonus* token is the one token the target emits after the
last accepted node: a *correction* when a draft child there was rejected, a
free extra token when the path ran out of draft. Each round therefore commits
``len(accepted) + 1`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.speculation.acceptance import EXACT, AcceptanceRule, judging_probs, likely_enough
from workers.speculation.sampling import (
    SamplingParams,
    first_argmax,
    sample,
    target_probs,
    uniform,
)
from workers.speculation.tree import TokenTree, children, leaf_paths, validate_tree

# A residual with less mass than this is float noise around "p == q"; a
# rejection there has probability below it, so the fallback changes nothing
# measurable (see _residual).
_RESIDUAL_EPS = 1e-6


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one tree."""

    accepted: list[int]  # node indices of the accepted root-to-node path, in order
    bonus: int  # token the target emits after the last accepted node


def _check_logits(tree: TokenTree, logits: torch.Tensor) -> None:
    """Raise unless logits is (N+1, V) float and the tree is valid for vocabulary V."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise ValueError("logits must be a floating-point tensor")
    n = len(tree)
    if logits.dim() != 2 or logits.shape[0] != n + 1:
        raise ValueError(
            f"logits must have shape (N+1={n + 1}, V) (row 0: after the root, row i+1: "
            f"after node i), got {tuple(logits.shape)}"
        )
    validate_tree(tree, vocab_size=logits.shape[1])


def greedy_verify(tree: TokenTree, logits: torch.Tensor) -> Verdict:
    """Longest draft path that the target's argmax agrees with, then the argmax after it.

    A node is accepted iff its token equals the target argmax at its parent
    and its parent is accepted. Medusa's form: the matches along every leaf
    path, up to its first miss, give its accepted length; the longest wins,
    and on equal length the first leaf path in depth-first order (that is,
    through elder siblings, which only matters for identical-token siblings).
    The bonus is the argmax after the last accepted node (after the root when
    none is).
    """
    _check_logits(tree, logits)
    best = first_argmax(logits)  # (N+1,) target choice after root / after node i
    if not len(tree):  # no draft (speculation off, or not worth it this round)
        return Verdict(accepted=[], bonus=int(best[0]))
    tokens, parents = tree.tokens.cpu(), tree.parents.cpu()  # (N,), (N,)
    accepted = _longest_path(tree, tokens == best[parents + 1])  # node token == its argmax
    bonus_row = accepted[-1] + 1 if accepted else 0
    return Verdict(accepted=accepted, bonus=int(best[bonus_row]))


def _longest_path(tree: TokenTree, match: torch.Tensor) -> list[int]:
    """The longest root-to-node path whose nodes all `match` (N,) bool; on equal length the
    first leaf path in depth-first order."""
    ok = match.tolist()  # a few dozen nodes: a walk in Python, no tensor ops per round
    best: list[int] = []
    for path in leaf_paths(tree.parents):
        n = 0
        while n < len(path) and ok[path[n]]:
            n += 1
        if n > len(best):  # strictly longer: the first leaf path keeps a tie
            best = path[:n]
    return best


def lossy_verify(
    tree: TokenTree,
    logits: torch.Tensor,
    params: SamplingParams,
    rule: AcceptanceRule,
    generator: torch.Generator | None,
) -> Verdict:
    """A lossy rule (workers.speculation.acceptance): the longest path whose every token is
    the target's argmax or likely enough under the rule, then the target's next token."""
    _check_logits(tree, logits)
    logits = logits.float().cpu()  # (N+1, V)
    probs = judging_probs(logits, params)  # (N+1, V)
    tokens, parents = tree.tokens.cpu(), tree.parents.cpu()  # (N,), (N,)
    rows = parents + 1  # (N,) the row that judges node i: after its parent
    best = first_argmax(logits)  # (N+1,)
    match = (tokens == best[rows]) | likely_enough(rule, probs, tokens, rows)
    accepted = _longest_path(tree, match)  # (N,) bool in, node indices out
    row = accepted[-1] + 1 if accepted else 0
    if params.greedy:
        return Verdict(accepted=accepted, bonus=int(best[row]))
    if generator is None:
        raise ValueError("sampled verification needs the request's generator")
    return Verdict(accepted=accepted, bonus=sample(probs[row], generator))


def _dense_q(tree: TokenTree, node: int, like: torch.Tensor) -> torch.Tensor:
    """Node's draft distribution as a dense (V,) vector on ``like``'s device."""
    q = torch.zeros_like(like)  # (V,)
    if tree.q_tokens is None or tree.q_probs is None:
        q[int(tree.tokens[node])] = 1.0  # deterministic draft: one-hot on its token
        return q
    idx = tree.q_tokens[node].to(like.device)  # (K,)
    val = tree.q_probs[node].to(device=like.device, dtype=like.dtype)  # (K,)
    q.index_add_(0, idx, val)  # add, not assign: padding may repeat a real id with prob 0
    return q / q.sum()  # (V,) renormalise away rounding in the stored row


def _residual(p: torch.Tensor, q: torch.Tensor, rejected: list[int]) -> torch.Tensor:
    """Target distribution after rejecting a draw from q: normalize(max(0, p - q)).

    If that has (numerically) no mass, p and q were equal up to rounding and a
    rejection had probability ~0; fall back to p with the rejected tokens
    removed, and if even that is empty, to p itself. Never NaN.
    """
    r = (p - q).clamp(min=0)  # (V,)
    mass = float(r.sum())
    if mass > _RESIDUAL_EPS:
        return r / mass
    r = p.clone()  # (V,)
    r[rejected] = 0
    mass = float(r.sum())
    return r / mass if mass > 0 else p


def stochastic_verify(
    tree: TokenTree,
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
) -> Verdict:
    """Lossless multi-draft speculative sampling over a tree (recursive rejection sampling).

    Rule (SpecInfer, Miao et al. 2023; Sequoia, Chen et al. 2024; Recursive
    Speculative Decoding, Jeon et al. 2024; single-draft case: Leviathan et
    al. 2023): start at the root with p = target_probs(its row). For the
    current node's children c_1..c_k in sibling order, each drawn from q_i,
    accept c_i with probability min(1, p(x_i) / q_i(x_i)); on accept move to
    c_i and start again with its row; on reject set p <- normalize(max(0, p -
    q_i)) and try c_{i+1}. When no child is left (or the node is a leaf),
    the bonus token is sampled from the current p.

    Why the emitted token at each node is distributed exactly as p: for one
    child, P(emit y) = min(p(y), q(y)) + (1 - sum_z min(p(z), q(z))) *
    r(y) with r = (p - q)+ / sum (p - q)+, and since sum (p - q)+ = 1 - sum
    min(p, q) this is min(p, q)(y) + (p - q)+(y) = p(y). With several
    children, q_{i+1} is the draft distribution given c_1..c_i drawn (elder
    siblings removed when drawing without replacement), and the residual
    after rejecting c_i depends on q_i but not on the value x_i, so by
    induction over i the tail (children i+1.., then the bonus) emits the
    residual exactly, and the one-child identity closes the step. Accepted
    children's subtrees were drawn conditional on their path, so the same
    holds at the next level, and every committed token follows the target.
    A deterministic draft is the case q_i = one-hot(x_i).

    Requires the tree's q rows (or none, for deterministic drafts) to be the
    actual distributions the children were drawn from, conditional on elder
    siblings *and on the node being in the tree*: a tree trimmed to a budget
    must keep every kept node's elder siblings, and must not decide whether
    to keep a node by looking at that node's own token (see
    ``TreeBuilder._select``). Deterministic drafts need neither: the one-hot
    rule is exact for any candidate set.
    """
    _check_logits(tree, logits)
    kids = children(tree.parents)
    tokens = tree.tokens.tolist()
    node = -1  # the root
    accepted: list[int] = []
    while True:
        # (V,) target distribution after the current node: only the rows the walk visits
        # (the accepted path and the bonus's parent) pay the vocabulary-wide softmax/top-p
        p = target_probs(logits[node + 1], params)
        rejected: list[int] = []
        for child in kids[node + 1]:
            x = tokens[child]
            q = _dense_q(tree, child, p)  # (V,)
            px, qx = float(p[x]), float(q[x])
            # accept x with probability min(1, p(x) / q(x)), i.e. iff u * q(x) < p(x);
            # on reject the target moves to the residual max(0, p - q), renormalised,
            # and the next sibling (drawn from q with x removed) gets its turn
            if uniform(generator) * qx < px:
                accepted.append(child)
                node = child
                break
            rejected.append(x)
            p = _residual(p, q, rejected)  # (V,)
        else:
            # no child accepted (or a leaf): the bonus comes from what is left of p
            return Verdict(accepted=accepted, bonus=sample(p, generator))


def verify(
    tree: TokenTree,
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    rule: AcceptanceRule = EXACT,
) -> Verdict:
    """Greedy verification at temperature 0, lossless stochastic verification otherwise;
    a lossy rule only when the call carries one."""
    if not rule.lossless:
        return lossy_verify(tree, logits, params, rule, generator)
    if params.greedy:
        return greedy_verify(tree, logits)
    if generator is None:
        raise ValueError("stochastic verification needs the request's generator")
    return stochastic_verify(tree, logits, params, generator)
