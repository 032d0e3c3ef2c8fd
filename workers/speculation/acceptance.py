"""Acceptance rules: the lossless one, and the lossy ones a request may opt into.

"exact" (the default) is greedy or stochastic verification (verify.py): the
output is the target's own. The lossy rules accept a draft token that the
target merely finds likely enough, so rounds accept more and the text may
differ from the target's; the gateway serves them only when the server allows
it (--allow-lossy) and the request asks, and marks such responses.

Both judge a draft token x at a node by p, the target's distribution at the
node's parent: at the request's temperature, or at temperature 1 when greedy
(a one-hot argmax would make every rule exact), with its top-k / top-p.
- threshold (the treehacks seed's strategy): accept x iff p(x) >= t;
- typical (Medusa, Cai et al. 2024, "typical acceptance"): accept x iff
  p(x) > min(epsilon, delta * exp(-H(p))): a peaked p (low entropy H)
  demands up to epsilon, a flat one lets less likely tokens through.
The target's own choice (its argmax) is always accepted too. A node counts
only when its whole path is accepted; the longest such path wins (Medusa's
cumprod rule, as greedy verification), and the bonus token after it is the
target's argmax (greedy) or a draw from p (sampling).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch

from workers.speculation.sampling import SamplingParams, target_probs

Rule = Literal["exact", "threshold", "typical"]


@dataclass(frozen=True)
class AcceptanceRule:
    """How the target accepts draft tokens."""

    kind: Rule = "exact"  # exact is the only lossless rule
    threshold: float = 0.1  # "threshold": least target probability of an accepted token
    epsilon: float = 0.09  # "typical": the most probability ever demanded (Medusa's 0.09)
    delta: float = 0.3  # "typical": scale of exp(-entropy) (Medusa's 0.3)

    def __post_init__(self):
        if self.kind not in ("exact", "threshold", "typical"):
            raise ValueError(f"unknown acceptance rule {self.kind!r}")
        for name in ("threshold", "epsilon", "delta"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"acceptance {name} must be in (0, 1], got {getattr(self, name)}")

    @property
    def lossless(self) -> bool:
        return self.kind == "exact"

    def describe(self) -> str:
        """ "exact", "threshold; t=0.1" or "typical; epsilon=0.09; delta=0.3" (a header value)."""
        if self.kind == "threshold":
            return f"threshold; t={self.threshold:g}"
        if self.kind == "typical":
            return f"typical; epsilon={self.epsilon:g}; delta={self.delta:g}"
        return "exact"


EXACT = AcceptanceRule()


def judging_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(N+1, V) the distribution a lossy rule judges by: the request's, at temperature 1 when
    the request is greedy."""
    temperature = params.temperature if not params.greedy else 1.0
    return target_probs(logits, replace(params, temperature=temperature, seed=None))


def likely_enough(
    rule: AcceptanceRule, probs: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """(N,) bool: whether node i's token `tokens[i]` passes the rule at row `rows[i]` of
    `probs` (R, V)."""
    p = probs[rows, tokens]  # (N,) the target's probability of each node's token
    if rule.kind == "threshold":
        return p >= rule.threshold
    if rule.kind == "typical":
        entropy = torch.special.entr(probs).sum(dim=-1)  # (R,)
        bar = torch.clamp(rule.delta * torch.exp(-entropy), max=rule.epsilon)  # (R,)
        return p > bar[rows]
    raise ValueError("the exact rule is verified by verify.verify")
