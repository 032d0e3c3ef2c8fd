"""Adaptive speculation: each round's tree sized to the session's acceptance and the target's load.

A tree of N nodes buys expected accepted tokens and costs target compute.
Both sides are estimated per round:

- gain: a session's recent per-token acceptance rate alpha, estimated from
  its last rounds (exponentially weighted). With a chain of depth D, a round
  emits E(D) = (1 - alpha^(D+1)) / (1 - alpha) tokens on average (Leviathan
  et al. 2022: accepted draft tokens plus the bonus token).
- cost: a round whose target forward takes n tokens lasts about a + b*n
  (weights are read once, then compute grows with the tokens; the round's
  network and gateway time adds to a). `knee_tokens` = a / b is the round's
  fixed cost in tokens: about 30 for a 135M model on a 2-core CPU (forward of
  1 token 23 ms, of 17 tokens 34 ms, plus ~5 ms of gRPC and gateway), hundreds
  on a GPU (speed is flat in it: 20 to 48 move tokens/s by 1-3% in
  simulation). The target batches the rounds of its S live sessions, so a
  round in which every session feeds 1 + N tokens costs knee + S * (1 + N).

The depth maximises tokens per unit of target time, E(D) / (knee + S(1 + D)),
over 0..max depth. The tree keeps the configured shape's nodes-per-level
(budget / depth), so a wide tree narrows as it gets shallower. D = 0 turns
speculation off for the round; every `probe_every`-th such round still
drafts one level, so the estimate can recover when the text turns copyable.

This is what vLLM's and TGI's fixed speculation lacks: at high load the
forward is compute-bound, extra tree nodes cost as much as real tokens, and a
fixed tree makes serving slower than plain decoding. Here the tree shrinks
with S and with alpha, down to plain decoding.

Acceptance estimate: a round that accepted `a` tokens of a path `d` deep
either stopped on a rejection (a < d) or used up the path (a == d, censored).
For a geometric run length the maximum-likelihood alpha is sum(a) /
(sum(a) + rejections); both sums are exponentially weighted (weight `ewma`
for the newest round). A new session starts from the same estimate kept
over every session's rounds (the gateway's recent acceptance with this
draft), or from `prior_rate` before the first round.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from workers.protocol import TreeSpec


@dataclass(frozen=True)
class AdaptiveConfig:
    """How trees adapt (gateway settings `--adaptive-*`)."""

    knee_tokens: float = 32.0  # a round's fixed cost, in tokens fed (a / b)
    ewma: float = 0.3  # weight of the newest round in the acceptance estimate
    prior_rate: float = 0.8  # per-token acceptance assumed before the first round
    probe_every: int = 8  # with speculation off, draft one level every this many rounds

    def __post_init__(self):
        if self.knee_tokens < 0 or not 0 < self.ewma <= 1 or not 0 <= self.prior_rate < 1:
            raise ValueError(
                f"need knee_tokens >= 0, 0 < ewma <= 1, 0 <= prior_rate < 1; got "
                f"{self.knee_tokens}, {self.ewma}, {self.prior_rate}"
            )
        if self.probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {self.probe_every}")


@dataclass
class Acceptance:
    """A session's recent acceptance: exponentially weighted accepted tokens and rejections."""

    accepted: float  # weighted draft tokens accepted per round
    rejected: float  # weighted share of rounds that ended on a rejected token
    rounds_off: int = 0  # rounds in a row decoded without a draft

    @classmethod
    def prior(cls, config: AdaptiveConfig) -> Acceptance:
        """One round's worth of belief that alpha = prior_rate."""
        return cls(accepted=config.prior_rate, rejected=1.0 - config.prior_rate)

    @property
    def rate(self) -> float:
        """Estimated per-token acceptance alpha (the geometric MLE)."""
        total = self.accepted + self.rejected
        return self.accepted / total if total > 0 else 0.0

    def observe(self, accepted: int, path_depth: int, config: AdaptiveConfig) -> None:
        """One verified round: `accepted` tokens along a tree `path_depth` deep."""
        if path_depth <= 0:  # nothing was drafted: nothing learnt
            return
        w = config.ewma
        self.accepted += w * (accepted - self.accepted)
        self.rejected += w * (float(accepted < path_depth) - self.rejected)


def expected_tokens(rate: float, depth: int) -> float:
    """Tokens a round emits with a chain `depth` deep: 1 + alpha + ... + alpha^depth."""
    if rate >= 1.0:
        return depth + 1.0
    return (1.0 - rate ** (depth + 1)) / (1.0 - rate)


def best_depth(rate: float, sessions: int, max_depth: int, knee_tokens: float) -> int:
    """The depth with the most tokens per unit of target time (0 = no speculation)."""
    s = max(1, sessions)

    def speed(d: int) -> float:
        return expected_tokens(rate, d) / (knee_tokens + s * (1 + d))

    return max(range(max_depth + 1), key=lambda d: (speed(d), -d))  # ties: the shallower


def adapt(
    spec: TreeSpec, acceptance: Acceptance, sessions: int, config: AdaptiveConfig
) -> TreeSpec | None:
    """This round's tree within `spec` (the largest allowed), or None for no speculation.

    `sessions` is the number of live sessions on the target this session uses.
    """
    if spec.depth <= 0 or spec.budget <= 0:
        return None
    depth = best_depth(acceptance.rate, sessions, spec.depth, config.knee_tokens)
    if depth == 0:
        acceptance.rounds_off += 1
        if acceptance.rounds_off % config.probe_every:
            return None
        depth = 1  # a probe keeps the estimate alive
    else:
        acceptance.rounds_off = 0
    per_level = spec.budget / spec.depth  # the configured shape's nodes per level
    budget = max(depth, min(spec.budget, round(depth * per_level)))
    return replace(spec, depth=depth, budget=budget)
