"""One session's speculation rounds as pure bookkeeping.

The caller owns the truth: `history`, the prompt and every committed token.
A round asks the draft for a tree no deeper than the tokens still wanted
and no larger than the target accepts (`fit`), has the target verify it,
and `commit`s what the target emitted: the accepted path and the bonus
token, cut at max_tokens or at a stop token. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from workers.protocol import TokenLogprob, TreeSpec, VerifyOutcome
from workers.speculation.acceptance import EXACT, AcceptanceRule
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree


@dataclass(frozen=True)
class Plan:
    """What one generation asks for, tokenized and checked."""

    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    spec: TreeSpec = TreeSpec()  # the largest tree to propose per round
    stop_ids: frozenset[int] = frozenset()  # tokens that end the generation (eos)
    num_logprobs: int = -1  # -1: none; k >= 0: each token's logprob and top k
    acceptance: AcceptanceRule = EXACT  # lossy rules only when the request opted in
    tenant: str | None = ""  # whose request (see ProposeCall.tenant); '' = no API key
    cache_salt: str = ""  # its workers share KV prefixes only with the same salt ('' = all)

    def __post_init__(self):
        if not self.prompt:
            raise ValueError("the prompt is empty")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")


@dataclass
class Counters:
    """Speculation counters of one generation (summed over a request's choices)."""

    draft_tokens: int = 0  # tree nodes sent to verification (and the target's own lookups)
    accepted_tokens: int = 0  # of them, accepted
    verify_steps: int = 0  # target forwards that committed tokens (a round's, or its steps)
    rounds: int = 0  # verify calls: round trips to the target, whatever they committed
    emitted_tokens: int = 0  # accepted + bonus tokens
    degraded_rounds: int = 0  # rounds without a draft because none answered
    prefix_hit_tokens: int = 0  # cached prompt tokens a target reused on (re)start
    history_resends: int = 0  # full histories re-sent after SessionLost
    failovers: int = 0  # moves to another worker after a failure
    lookahead_hits: int = 0  # rounds whose tree was drafted during the previous verify
    lookahead_misses: int = 0  # look-ahead trees discarded (the guess was wrong)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per target forward (tau): accepted nodes plus the bonus token."""
        return self.emitted_tokens / self.verify_steps if self.verify_steps else 0.0

    def add(self, other: Counters) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        rate, tau = round(self.acceptance_rate, 4), round(self.mean_accepted_length, 4)
        return {**out, "acceptance_rate": rate, "mean_accepted_length": tau}


@dataclass(frozen=True)
class Round:
    tokens: list[int]  # committed this round: accepted draft tokens, then the bonus token
    logprobs: list[TokenLogprob] | None  # one per token, when asked for
    finish_reason: str | None  # "stop" (a stop token), "length" (max_tokens) or None
    drafted: int = 0  # tree nodes verified this round (and the target's own lookups)
    accepted: int = 0  # of them, accepted (the bonus token comes on top)
    degraded: bool = False  # no draft answered: the target decoded alone
    prefix_hit: int = 0  # cached prompt tokens the target reused this round
    # the last token is the target's correction of a draft guess (the draft proposed a
    # child of the last accepted node, and the target chose otherwise), not a bonus token
    corrected: bool = False
    seconds: tuple[float, float] = (0.0, 0.0)  # its propose and verify calls' wall time
    steps: int = 1  # target forwards that made its tokens (VerifyCall.steps)
    # tokens the target's own lookup drafted during its steps (VerifyOutcome.lookup_nodes),
    # and the indices in `tokens` of those it accepted; both count in `drafted` / `accepted`
    lookup_nodes: int = 0
    looked_up: tuple[int, ...] = ()

    @property
    def tree_nodes(self) -> int:
        """Of `drafted`, the nodes of the tree the round sent."""
        return self.drafted - self.lookup_nodes

    @property
    def tree_accepted(self) -> int:
        """Of `accepted`, those of the tree the round sent."""
        return self.accepted - len(self.looked_up)


@dataclass
class LoopState:
    plan: Plan
    history: list[int] = field(init=False)  # the prompt, then every committed token
    counters: Counters = field(default_factory=Counters)
    finish_reason: str | None = None

    def __post_init__(self):
        self.history = list(self.plan.prompt)

    @property
    def generated(self) -> list[int]:
        return self.history[len(self.plan.prompt) :]

    @property
    def remaining(self) -> int:
        return self.plan.max_tokens - (len(self.history) - len(self.plan.prompt))

    def fit(self, spec: TreeSpec, max_nodes: int, extra: int = 0) -> TreeSpec | None:
        """`spec` no deeper than the tokens still wanted (the bonus token comes free) and no
        larger than the target's `max_nodes` (0 = no limit), drawn with the request's
        sampling; None when no tree is wanted. `extra`: tokens the tree is drafted ahead of
        the history (a look-ahead)."""
        depth = min(spec.depth, self.remaining - extra - 1)
        budget = min(spec.budget, max_nodes) if max_nodes > 0 else spec.budget
        if depth <= 0 or budget <= 0:
            return None
        params = self.plan.params
        return replace(
            spec, depth=depth, budget=budget, temperature=params.temperature, seed=params.seed
        )

    def commit(
        self,
        tree: TokenTree,
        outcome: VerifyOutcome,
        degraded: bool = False,
        seconds: tuple[float, float] = (0.0, 0.0),
    ) -> Round:
        """Appends the round's tokens to the history, cut at max_tokens or a stop token;
        `seconds`: the round's propose and verify calls' wall time, which the round carries."""
        remaining = self.remaining
        tokens = outcome.emitted[:remaining]
        stop = next((i for i, t in enumerate(tokens) if t in self.plan.stop_ids), None)
        if stop is not None:
            tokens, self.finish_reason = tokens[: stop + 1], "stop"
        elif len(tokens) == remaining:
            self.finish_reason = "length"
        self.history.extend(tokens)
        c = self.counters
        looked_up = tuple(i for i in outcome.lookup_accepted if i < len(tokens))
        c.draft_tokens += len(tree) + outcome.lookup_nodes
        c.accepted_tokens += len(outcome.accepted) + len(looked_up)
        c.verify_steps += outcome.steps
        c.rounds += 1
        c.emitted_tokens += len(outcome.emitted)
        c.degraded_rounds += degraded
        c.prefix_hit_tokens += outcome.prefix_hit
        logprobs = outcome.logprobs[: len(tokens)] if outcome.logprobs is not None else None
        last = outcome.accepted[-1] if outcome.accepted else -1  # -1: the root
        return Round(
            tokens,
            logprobs,
            self.finish_reason,
            len(tree) + outcome.lookup_nodes,
            len(outcome.accepted) + len(looked_up),
            degraded,
            outcome.prefix_hit,
            corrected=bool((tree.parents == last).any()) if len(tree) else False,
            seconds=seconds,
            steps=outcome.steps,
            lookup_nodes=outcome.lookup_nodes,
            looked_up=looked_up,
        )


@dataclass
class Generation:
    """A finished generation, for callers that want it whole."""

    token_ids: list[int]
    finish_reason: str
    stats: Counters
    elapsed_s: float

    def summary(self) -> dict:
        """`specsplit generate --json`'s stats."""
        s = self.stats
        tps = len(self.token_ids) / self.elapsed_s if self.elapsed_s else 0.0
        return {
            "draft_tokens": s.draft_tokens,
            "accepted_tokens": s.accepted_tokens,
            "verify_steps": s.verify_steps,
            "acceptance_rate": round(s.acceptance_rate, 4),
            "mean_accepted_length": round(s.mean_accepted_length, 4),
            "tokens_per_second": round(tps, 3),
        }
