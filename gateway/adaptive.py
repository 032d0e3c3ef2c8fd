"""Adaptive speculation: each round's tree sized to the session's acceptance and the target's cost.

A tree of N nodes buys expected accepted tokens and costs target time.
Both sides are estimated per round:

- gain: a session's recent per-token acceptance rate alpha, estimated from
  its last rounds (exponentially weighted). With a path of depth D, a round
  emits E(D) = (1 - alpha^(D+1)) / (1 - alpha) tokens on average (Leviathan
  et al. 2022: accepted draft tokens plus the bonus token).
- cost: a round whose target batch feeds n tokens lasts a + b*n + o seconds
  (weights are read once, then compute grows with the tokens; the call's
  network time adds to a; o is the round's time outside the call's work:
  the gateway's turn and the call's wait for the batch's other sessions).
  Each target worker's a and b are
  learnt online (`CostFit`) from what its Verify calls report: the tokens
  its batch's forward fed (cached prompt blocks are not fed; a prompt token,
  fed without logits, counts the share of a token's work it needs, so that
  prefills do not flatten the slope) and the call's seconds (the gateway's
  wall time less the time it queued on the worker); the calls of one batch
  share one forward, so each weighs 1 / the batch's calls. Before a target
  has answered, a / b is
  `knee_tokens` (`--adaptive-knee-tokens`). The fit is an exponentially
  weighted least-squares line, pulled towards that prior ratio with the
  weight of `prior_weight` rounds, so rounds that all feed the same number
  of tokens (which say nothing about the slope) keep the prior split. The
  target batches the rounds of its S live sessions, so a round in which
  every session feeds 1 + N(D) tokens (N(D): the tree's nodes at depth D)
  costs a + b * S * (1 + N(D)), plus the draft's measured seconds per level
  times D (a model draft expands the tree level by level; n-gram drafts
  cost nothing).

A round without a draft may have the target decode k tokens in a row
(`--decode-steps`, VerifyCall.steps): its forwards follow each other in the
worker, and the time besides them (o and the call's transit, measured from
the one-forward rounds as their seconds since the round before less the
forward's) comes once. Its tokens cost plain = a + b S + o - beside (1 - 1/k)
each: where that time is a fair share of a round (a 2-core machine's gateway
shares the target's cores), a tree must beat the steps, not a token a round.
o and beside are weighted means over each target's rounds, with `cost_ewma`.
A session whose drafts may pay keeps a token a round after an accepted draft
(a lookup at every token, for text that copies its prompt) only while such
rounds bring what rounds of steps would have in their time (`Pace`): on
open-ended chat they mostly find no draft, and each then costs a round trip
for one token.

The shape maximises expected tokens per second of round time,
E(D) / (a + b S (1 + N) + o + D * level_s) against 1 / plain for no draft,
over depths 0..max and two shapes
at each depth: the configured shape cut to D levels (its nodes-per-level,
budget / depth, kept, so a wide tree narrows as it gets shallower; N =
N(D), at the trees' acceptance) or a chain D deep (N = D, at the spines'
acceptance: a tree's spine, each node's first child, is the draft's best
path, so every tree round also measures what a chain would have accepted).
Where tokens are dear a chain often pays and the tree does not: the other
branches rarely catch what the spine misses. D = 0 turns speculation off
for the round (it does not pay: a slow or compute-bound target, low
acceptance, many sessions). Once the sessions have not drafted a kind of
round for `probe_every` times S rounds between them, the next to weigh it
drafts one node (a probe), so the estimates can recover when the text turns
copyable. The period grows with S because the target batches the S
sessions' rounds: a probe's node costs the whole batch its forward time and,
fed beside one-token decodes, a second attention call
(workers/engine/batch.py). This way a batch carries about one probe every
`probe_every` forwards, whatever S. The rounds are counted over every
session (`adapt`'s `probes`): a count of one session's own, 8 × S of them,
never came within a request at 8 or more streams (16-18 rounds of 64
tokens), so once no session drafted a kind its estimate stayed where the last
drafted rounds left it, and the verdict "no draft pays" kept itself true
(bench/runs/2026-11-28-reweigh).

Above the rounds, a target's sessions draft in turns of epochs
(gateway/epochs.py): in its plain epochs no session looks up or drafts, and
the kind of epoch whose rounds measure more tokens a second at the target's
load runs most of the time. That measures what the model here cannot price
at a busy target: a drafted round's nodes in the other sessions' forwards,
and a token a round waiting on other sessions' runs of steps.

This is what vLLM's and TGI's fixed speculation lacks: at high load the
forward is compute-bound, extra tree nodes cost as much as real tokens, and a
fixed tree makes serving slower than plain decoding. Here the tree shrinks
with S, with alpha and with the target's measured cost per token, down to
plain decoding; and grows where a round's fixed cost dominates (a GPU, a
slow network).

Acceptance estimates (`Rates`: one for trees, one for spines): a round
that accepted `a` tokens of a path `d` deep either stopped on a rejection
(a < d) or used up the path (a == d, censored).
For a geometric run length the maximum-likelihood alpha is sum(a) /
(sum(a) + rejections); both sums are exponentially weighted (weight `ewma`
for the newest round). Until it has drafted a round of its own, a session
follows the estimate kept over every session's rounds (the gateway's recent
acceptance with this draft; `prior_rate` before any round), so sessions that
start together learn from each other's first rounds. A session drafts when
its recent rounds went well, and the rounds after a good streak accept less
than it promised, most on open-ended text: the expected accepted tokens,
E(D) - 1, are scaled by what drafted rounds accepted against what their
estimates promised, at the round's depth, over every session's recent rounds
(`Calibration`).

An n-gram draft's rounds are told apart by how long a suffix its lookup
matched (`RatesByMatch`): on chat a 1-token match's first token is the
target's 15% of the time and a 3-token match's 83%, and a session's last
rounds cannot tell the two apart, so with one estimate a busy target's
sessions drafted after neither (bench/RESULTS.md). Each length keeps its
own estimates, calibration and probes; a round with no match drafts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from workers.protocol import TreeSpec
from workers.speculation.ngram import MAX_NGRAM


@dataclass(frozen=True)
class AdaptiveConfig:
    """How trees adapt (gateway settings `--adaptive-*`)."""

    knee_tokens: float = 32.0  # a round's fixed cost in tokens fed (a / b) until measured
    ewma: float = 0.3  # weight of the newest round in the acceptance estimate
    prior_rate: float = 0.8  # per-token acceptance assumed before the first round
    probe_every: int = 8  # with speculation off, draft one node every this many rounds x S
    cost_ewma: float = 0.05  # weight of the newest round in a target's cost fit
    prior_weight: float = 1.0  # rounds' worth of belief in knee_tokens once a target is measured
    calibration_ewma: float = 0.02  # weight of the newest drafted round in the calibration
    # each drafted round pulls every other depth's calibration this far towards every depth's
    depth_relax: float = 0.002
    pace_ewma: float = 0.1  # weight of the newest round of a token at a time in a `Pace`
    # drafting and plain epochs (gateway.epochs): an epoch's seconds, the weight of the
    # newest epoch in a kind's rates, how often the slower kind runs, each kind's first epochs
    epoch_s: float = 2.0
    epoch_ewma: float = 0.2
    explore_every: int = 8
    warm_epochs: int = 2

    def __post_init__(self):
        if self.knee_tokens < 0 or not 0 < self.ewma <= 1 or not 0 <= self.prior_rate < 1:
            raise ValueError(
                f"need knee_tokens >= 0, 0 < ewma <= 1, 0 <= prior_rate < 1; got "
                f"{self.knee_tokens}, {self.ewma}, {self.prior_rate}"
            )
        if self.probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {self.probe_every}")
        if (
            self.epoch_s <= 0
            or not 0 < self.epoch_ewma <= 1
            or self.explore_every < 2
            or self.warm_epochs < 0
        ):
            raise ValueError(
                "need epoch_s > 0, 0 < epoch_ewma <= 1, explore_every >= 2, warm_epochs >= 0; "
                f"got {self.epoch_s}, {self.epoch_ewma}, {self.explore_every}, {self.warm_epochs}"
            )
        if (
            not 0 < self.cost_ewma <= 1
            or self.prior_weight <= 0
            or not 0 < self.calibration_ewma <= 1
            or not 0 <= self.depth_relax <= 1
            or not 0 < self.pace_ewma <= 1
        ):
            raise ValueError(
                "need 0 < cost_ewma <= 1, prior_weight > 0, 0 < calibration_ewma <= 1, "
                f"0 <= depth_relax <= 1, 0 < pace_ewma <= 1; got {self.cost_ewma}, "
                f"{self.prior_weight}, {self.calibration_ewma}, {self.depth_relax}, "
                f"{self.pace_ewma}"
            )


@dataclass(frozen=True)
class RoundCost:
    """Seconds of one round: a + b * tokens the target's batch feeds + the draft's per level
    + the round's time outside its verify call; and what decode steps save a round without
    a draft."""

    fixed_s: float  # a: what a verify call costs whatever it feeds (weights, network)
    token_s: float  # b: what each token fed adds
    level_s: float = 0.0  # the draft's seconds per tree level (0: an n-gram draft)
    # the round's time outside the call's work: the gateway's turn (commit, stream, the next
    # call) and the call's wait in the target's queue for the other sessions' calls
    outside_s: float = 0.0
    # of a round of one forward, the time besides the target's forward (the outside time
    # and the call's transit): a round of decode steps pays it once for its forwards
    beside_s: float = 0.0
    steps: int = 1  # the tokens a round without a draft decodes (VerifyCall.steps)

    @classmethod
    def prior(cls, config: AdaptiveConfig) -> RoundCost:
        """The unmeasured target, in units of one token's cost: a / b = knee_tokens."""
        return cls(config.knee_tokens, 1.0)

    def seconds(self, tokens: float, depth: float) -> float:
        return self.fixed_s + self.outside_s + self.token_s * tokens + self.level_s * depth

    def plain(self, tokens: float) -> float:
        """Seconds a token of a round without a draft that feeds `tokens`: its forwards
        follow each other in the target, and the time besides them comes once a round."""
        steps = max(1, self.steps)
        one = self.seconds(tokens, 0)  # k forwards and the time besides: at least a round's
        return max(one - self.beside_s * (1.0 - 1.0 / steps), one / steps)


@dataclass
class CostFit:
    """A target's round cost a + b*n, fitted online to (tokens fed, seconds) of its rounds.

    Exponentially weighted least squares (the recursive form keeps five sums),
    regularised towards the line through the data's mean with a / b =
    knee_tokens: pseudo-rounds of total weight `prior_weight` on that line,
    one token either side of the mean. They weigh like a fraction of one
    round one token off the mean, so any spread in the rounds' sizes
    outweighs them, and only rounds that all feed the same tokens keep the
    prior's split of their cost.
    """

    weight: float = 0.0  # sum of w
    tokens: float = 0.0  # sum of w * n
    tokens2: float = 0.0  # sum of w * n^2
    seconds: float = 0.0  # sum of w * t
    product: float = 0.0  # sum of w * n * t
    # one-forward rounds' gaps (`observe_gaps`), weighted alike: sums of w, w * outside_s,
    # w * beside_s
    gaps: tuple[float, float, float] = (0.0, 0.0, 0.0)
    # the last line and the config it was fitted with: every session of a batch asks for
    # it between the batch's answers (each observed) and its next forward
    fitted: tuple[AdaptiveConfig, RoundCost] | None = field(default=None, compare=False)

    def observe(
        self, tokens: int, seconds: float, config: AdaptiveConfig, share: float = 1.0
    ) -> None:
        """One call's round: its batch fed `tokens` in `seconds`. The calls of one batch
        report the same forward; each weighs `share` of a round (1 / the batch's calls), so
        a forward counts once, however many sessions it served."""
        if tokens <= 0 or seconds <= 0 or share <= 0:
            return
        self.fitted = None
        keep = (1.0 - config.cost_ewma) ** share
        self.weight = keep * self.weight + share
        self.tokens = keep * self.tokens + share * tokens
        self.tokens2 = keep * self.tokens2 + share * tokens * tokens
        self.seconds = keep * self.seconds + share * seconds
        self.product = keep * self.product + share * tokens * seconds

    def observe_gaps(
        self, outside_s: float, beside_s: float, config: AdaptiveConfig, share: float = 1.0
    ) -> None:
        """One call's round of one forward: its seconds outside the call's work and besides
        the target's forward (`RoundCost`), weighing `share` of a round as in `observe`."""
        if outside_s < 0 or beside_s < 0 or share <= 0:
            return
        self.fitted = None
        keep = (1.0 - config.cost_ewma) ** share
        weight, outside, beside = (keep * total for total in self.gaps)
        self.gaps = weight + share, outside + share * outside_s, beside + share * beside_s

    def line(self, config: AdaptiveConfig) -> RoundCost:
        """The fitted cost; the prior (in token units) before any round."""
        if self.weight <= 0:
            return RoundCost.prior(config)
        if self.fitted is None or self.fitted[0] is not config:
            self.fitted = config, self.fit(config)
        return self.fitted[1]

    def fit(self, config: AdaptiveConfig) -> RoundCost:
        """The line the sums give with the prior's pseudo-rounds (see the class docstring)."""
        knee = config.knee_tokens
        mean_n, mean_t = self.tokens / self.weight, self.seconds / self.weight
        prior_b = mean_t / (knee + mean_n)  # the prior line through the data's mean
        w, n, n2, t, nt = self.weight, self.tokens, self.tokens2, self.seconds, self.product
        for pn in (mean_n - 1.0, mean_n + 1.0):
            pw, pt = config.prior_weight / 2, prior_b * (knee + pn)
            w, n, n2, t, nt = w + pw, n + pw * pn, n2 + pw * pn * pn, t + pw * pt, nt + pw * pn * pt
        det = w * n2 - n * n  # > 0: the two pseudo-rounds differ in n
        b = (w * nt - n * t) / det
        a = (t - b * n) / w
        b = max(b, 1e-3 * prior_b)  # a round never gets cheaper with more tokens
        weight, outside, beside = self.gaps
        if weight <= 0:
            return RoundCost(max(a, 0.0), b)
        return RoundCost(max(a, 0.0), b, outside_s=outside / weight, beside_s=beside / weight)


@dataclass
class Acceptance:
    """Recent acceptance of one kind of draft: exponentially weighted accepted tokens and
    rejections."""

    accepted: float  # weighted draft tokens accepted per round
    rejected: float  # weighted share of rounds that ended on a rejected token

    @classmethod
    def prior(cls, rate: float) -> Acceptance:
        """One round's worth of belief that alpha = `rate`."""
        return cls(accepted=rate, rejected=1.0 - rate)

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


@dataclass
class Ratio:
    """Weighted draft tokens accepted against those promised (each an exponentially weighted
    mean per drafted round)."""

    promised: float = 1.0
    accepted: float = 1.0

    def observe(self, promised: float, accepted: float, weight: float) -> None:
        self.promised += weight * (promised - self.promised)
        self.accepted += weight * (accepted - self.accepted)

    @property
    def factor(self) -> float:
        return self.accepted / self.promised if self.promised > 0 else 1.0


@dataclass
class Calibration:
    """Draft tokens that drafted rounds accepted against those their estimates promised, by
    the rounds' depth.

    A session drafts when its recent rounds went well, and copied runs end: the
    rounds that follow a good streak accept less than the streak promised
    (regression to the mean), most on open-ended text. And acceptance is not
    geometric: on chat, at 8 streams, one- and two-level chains accepted about
    what they promised while chains five and six deep accepted a quarter to
    half of it (bench/RESULTS.md). So each depth's promise is scaled by its own
    `factor`, measured over every session's recent drafted rounds of that depth
    (weight `calibration_ewma` for the newest, as for the ratio over every
    depth's rounds: a depth learnt at another pace would look better or worse
    than the depths not drafted yet only for learning faster). A depth not
    drafted yet starts from the ratio over every depth's rounds, and every
    drafted round pulls the other depths' ratios `depth_relax` of the way
    towards it: a depth whose rounds fell short is not drafted, so it learns
    nothing of its own, and without the pull it would stay cut when the text
    turns copyable and the shallower rounds' promises come true (about 350
    drafted rounds halve its distance).
    """

    overall: Ratio = field(default_factory=Ratio)  # every depth's rounds
    by_depth: dict[int, Ratio] = field(default_factory=dict)  # a tree's depth -> its rounds'

    def observe(self, depth: int, promised: float, accepted: int, config: AdaptiveConfig) -> None:
        ratio = self.by_depth.get(depth)
        if ratio is None:
            ratio = self.by_depth[depth] = replace(self.overall)
        ratio.observe(promised, accepted, config.calibration_ewma)
        self.overall.observe(promised, accepted, config.calibration_ewma)
        for other in self.by_depth.values():
            if other is not ratio:
                other.observe(self.overall.promised, self.overall.accepted, config.depth_relax)

    def factor(self, depth: int) -> float:
        """What rounds `depth` deep accept of their promise."""
        return self.by_depth.get(depth, self.overall).factor

    def most(self) -> float:
        """The largest factor of any depth: a bound on every depth's."""
        return max([self.overall.factor, *(r.factor for r in self.by_depth.values())])


@dataclass
class Rates:
    """A session's (or every session's) recent acceptance of whole trees and of their spines.

    The spine is the draft's best path (each node's first child): what a chain as deep
    would have drafted, so every tree round also measures the chain. A chain round
    measures only the chain.
    """

    tree: Acceptance
    chain: Acceptance
    rounds_off: int = 0  # rounds in a row decoded without a draft
    calibration: Calibration = field(default_factory=Calibration)  # every session's
    measured: int = 0  # drafted rounds observed

    @classmethod
    def prior(cls, config: AdaptiveConfig, share: float = 1.0) -> Rates:
        """Estimates of alpha = `share` of the configured prior rate."""
        rate = share * config.prior_rate
        return cls(Acceptance.prior(rate), Acceptance.prior(rate))

    def fresh(self) -> Rates:
        """A new session's estimates: a copy of these rates, no rounds off yet, and the same
        calibration (kept over every session's rounds)."""
        return Rates(replace(self.tree), replace(self.chain), calibration=self.calibration)

    def follow(self, recent: Rates) -> None:
        """Until it has drafted a round, a session's estimates are every session's latest:
        sessions that start together would otherwise each draft on the estimate of their
        start (the prior, in a fresh gateway) until they had rounds of their own. They are
        shared, read only, until the session's first round (`observe` copies them then)."""
        if not self.measured:
            self.tree, self.chain = recent.tree, recent.chain

    def promise(self, round_: RoundShape) -> float:
        """Draft tokens these rates expect a round of that shape to accept."""
        rate = self.chain.rate if round_.is_chain else self.tree.rate
        return expected_tokens(rate, round_.depth) - 1.0

    def observe(
        self, round_: RoundShape, accepted: int, spine_accepted: int, config: AdaptiveConfig
    ) -> None:
        """One verified round: `accepted` tokens of the tree, `spine_accepted` of its spine."""
        if not self.measured:  # its own from now on, no longer every session's (`follow`)
            self.tree, self.chain = replace(self.tree), replace(self.chain)
        self.measured += 1
        self.chain.observe(spine_accepted, round_.spine, config)
        if not round_.is_chain:
            self.tree.observe(accepted, round_.depth, config)


@dataclass
class Pace:
    """What rounds of a token at a time bring where decode steps were on offer: the
    tokens they committed and the tokens rounds of steps would have committed in the same
    time, as the cost model prices both (`par`: the round's seconds over a stepped token's),
    exponentially weighted (`pace_ewma` for the newest round). Such rounds look a draft up
    at every token; on text that copies its prompt the drafts they find more than pay for
    the rest, on open-ended chat they mostly find none. Unmeasured, they pay."""

    tokens: float = 0.0
    par: float = 0.0

    def observe(self, tokens: int, par: float, config: AdaptiveConfig) -> None:
        if par <= 0:
            return
        if self.par <= 0:  # the first round: all there is to go on
            self.tokens, self.par = float(tokens), par
            return
        w = config.pace_ewma
        self.tokens += w * (tokens - self.tokens)
        self.par += w * (par - self.par)

    @property
    def pays(self) -> bool:
        return self.tokens >= self.par


@dataclass
class RatesByMatch:
    """Rates by the kind of round: an n-gram draft's by the length of the suffix its
    lookup matched (1 to MAX_NGRAM tokens; a round with no match drafts nothing), any
    other draft's all of kind 0. Each kind has its own estimates, calibration and probes;
    a shorter match starts from a proportionally lower prior (a 1-token match from a third
    of `prior_rate`). Beside them, the pace of rounds of a token at a time (`Pace`), which
    does not depend on the kind."""

    kinds: list[Rates]
    pace: Pace = field(default_factory=Pace)

    @classmethod
    def prior(cls, config: AdaptiveConfig) -> RatesByMatch:
        shares = [(kind or MAX_NGRAM) / MAX_NGRAM for kind in range(MAX_NGRAM + 1)]
        return cls([Rates.prior(config, share) for share in shares])

    def fresh(self) -> RatesByMatch:
        """A new session's: each kind's `Rates.fresh`, and every session's pace so far."""
        return RatesByMatch([rates.fresh() for rates in self.kinds], replace(self.pace))

    def __getitem__(self, kind: int) -> Rates:
        return self.kinds[kind]


@dataclass(frozen=True)
class RoundShape:
    """A drafted tree's size: its depth, its spine's length and its nodes."""

    depth: int
    spine: int
    nodes: int

    @property
    def is_chain(self) -> bool:
        """Every node on the spine: the round measured a chain, not a tree."""
        return self.nodes <= self.spine


def expected_tokens(rate: float, depth: int) -> float:
    """Tokens a round emits with a chain `depth` deep: 1 + alpha + ... + alpha^depth."""
    if rate >= 1.0:
        return depth + 1.0
    return (1.0 - rate ** (depth + 1)) / (1.0 - rate)


def tree_nodes(spec: TreeSpec, depth: int) -> int:
    """Nodes of the configured tree's shape cut to `depth` levels (budget / depth per level)."""
    if depth <= 0:
        return 0
    per_level = spec.budget / spec.depth
    return max(depth, min(spec.budget, round(depth * per_level)))


def can_pay(rates: Rates, sessions: int, cost: RoundCost) -> bool:
    """Whether any draft could beat plain decoding. Most rounds of a busy target end here,
    so they skip weighing every shape (`weigh_shapes`), and the answer is the same:

    - chains: a chain d deep gains g(d) = min(d, c (E(d) - 1)), concave in d and below
      G = c alpha / (1 - alpha), for a cost linear in d, C + delta d. So g(d) <= min(d g(1),
      G), and (1 + d g(1)) / (C + delta d) is monotone in d: the tokens per second of any
      depth are at most those at one level or where d g(1) reaches G (when the no-draft
      round cost C, as without decode steps, one level alone decides);
    - trees: every tree shape has two nodes or more, so it costs at least a round feeding
      3 tokens a session over one level, and gains at most c alpha / (1 - alpha) at the
      trees' acceptance (alpha held below 1).
    Each depth's calibration differs, so both bounds take the largest factor of any depth."""
    factor = rates.calibration.most()
    plain = 1.0 / cost.plain(sessions)
    first = min(1.0, factor * rates.chain.rate)  # g(1)
    rate = min(rates.chain.rate, 0.999)
    most = factor * rate / (1.0 - rate)  # G
    reach = max(1.0, most / first) if first > 0 else 1.0  # the depth where d g(1) reaches G
    chain = max(
        (1.0 + first) / cost.seconds(2 * sessions, 1),
        (1.0 + min(most, reach * first)) / cost.seconds(sessions * (1 + reach), reach),
    )
    rate = min(rates.tree.rate, 0.999)
    tree = (1.0 + factor * rate / (1.0 - rate)) / cost.seconds(3 * sessions, 1)
    return chain > plain or tree > plain


def best_shape(rates: Rates, sessions: int, spec: TreeSpec, cost: RoundCost) -> tuple[int, int]:
    """The (depth, nodes) with the most tokens per second of round time (`weigh_shapes`);
    (0, 0) = no speculation, at once where no draft can pay (`can_pay`)."""
    s = max(1, sessions)
    if not can_pay(rates, s, cost):
        return 0, 0
    return weigh_shapes(rates, s, spec, cost)


def weigh_shapes(rates: Rates, sessions: int, spec: TreeSpec, cost: RoundCost) -> tuple[int, int]:
    """The (depth, nodes) with the most tokens per second of round time, every shape
    weighed: the configured shape cut to a depth (at the trees' acceptance) or a chain as
    deep (at the spines'); (0, 0) = no speculation. Ties go to fewer nodes, then to the
    shallower."""
    s = max(1, sessions)
    chain, tree = rates.chain.rate, rates.tree.rate
    best, most = (0, 0), (1.0 / cost.plain(s), 0, 0)  # (speed, -nodes, -depth)
    # every gateway round of a session that may draft weighs these shapes: one pass, the
    # first best kept (a shape ties another only when slower to verify or deeper)
    for d in range(1, spec.depth + 1):
        factor = rates.calibration.factor(d)
        nodes = tree_nodes(spec, d)
        for n, rate in ((d, chain), (nodes, tree)) if nodes > d else ((d, chain),):
            gain = min(d, factor * (expected_tokens(rate, d) - 1.0))
            key = ((1.0 + gain) / cost.seconds(s * (1 + n), d), -n, -d)
            if key > most:
                best, most = (d, n), key
    return best


def adapt(
    spec: TreeSpec,
    rates: Rates,
    sessions: int,
    cost: RoundCost,
    config: AdaptiveConfig,
    probes: Rates | None = None,
) -> TreeSpec | None:
    """This round's tree within `spec` (the largest allowed), or None for no speculation.

    `sessions` is the number of live sessions on the target this session uses,
    `cost` that target's round cost; `probes` the rates whose rounds without a draft
    count towards this kind's probe (every session's; `rates` where None).
    """
    if spec.depth <= 0 or spec.budget <= 0:
        return None
    counted = rates if probes is None else probes
    depth, nodes = best_shape(rates, sessions, spec, cost)
    if depth > 0:
        counted.rounds_off = 0
        if nodes == depth:
            return replace(spec, depth=depth, branching=1, budget=depth)
        return replace(spec, depth=depth, budget=nodes)
    counted.rounds_off += 1
    if counted.rounds_off < config.probe_every * max(1, sessions):
        return None
    counted.rounds_off = 0
    return replace(spec, depth=1, branching=1, budget=1)  # a probe: one node keeps it alive
