"""The gateway's side of the speculation loop: pools, failover, adaptive trees, look-ahead.

The loop itself is workers.loop's `Loop` (propose -> verify -> commit ->
emit, re-sends after SessionLost); the gateway gives it:

- `PoolRoute`: the session's workers come from the router's pools. A draft
  that is down or busy is replaced by another (none left: the target decodes
  alone); a target that is down is replaced with the full history
  (failover), a busy one by another; none left -> 503 (429 when they were
  all busy); a call the target refuses as malformed -> 400. A call that
  hangs past its worker's bound (gateway.hangs) fails over like a crash.
- `Speculation`, the Loop with the gateway's hooks. Three options change how
  trees are made, never what is committed:
  - adaptive trees (gateway.adaptive): each round's depth and budget follow
    the session's recent acceptance, the target's live sessions and its
    round cost, learnt from each verify's tokens and seconds; an n-gram
    draft's acceptance is kept per length of the suffix its lookup matched;
  - the overlapped loop (gateway.overlap): while round k is verified, the
    draft already proposes round k+1 after the guess that round k accepts
    the tree's spine; a right guess saves the round its propose.
  - hybrid trees: with a model or feature draft worker, each round's tree
    is the gateway's own prompt lookup (and the tenant's suffix cache) merged
    with the worker's tree (workers.speculation.tree.merge_trees), so one
    verify checks both; the worker is asked only for the budget the n-gram
    tree leaves, and not at all when it fills it (copy-heavy text).
  and it exports each round's metrics.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field, replace
from typing import TypeVar

from gateway.adaptive import (
    AdaptiveConfig,
    Rates,
    RatesByMatch,
    RoundCost,
    RoundShape,
    adapt,
    best_shape,
)
from gateway.errors import APIError
from gateway.hangs import Hung
from gateway.metrics import Metrics
from gateway.overlap import Lookahead
from gateway.pool import Pool, Router, Worker, prompt_blocks
from workers.draft.ngram import MIN_MATCH, lookup_tree
from workers.draft.suffix import SuffixCache
from workers.engine.sessions import common_prefix
from workers.loop import Loop, LoopState, Plan, Round
from workers.loop.driver import ATTEMPTS
from workers.loop.inprocess import LOCAL_NGRAM
from workers.protocol import (
    InvalidCall,
    Role,
    TreeSpec,
    VerifyOutcome,
    WorkerBusy,
    WorkerDown,
    WorkerError,
)
from workers.speculation.ngram import MAX_NGRAM, SuffixIndex
from workers.speculation.tree import TokenTree, depths, spine

T = TypeVar("T")


@dataclass(frozen=True)
class LoopOptions:
    """How the loop makes trees (gateway settings); the committed tokens never depend on it."""

    adaptive: AdaptiveConfig | None = None  # None: every round proposes the plan's full tree
    overlap: bool = False  # draft round k+1 while round k is verified
    # merge the gateway's n-gram tree into a model or feature draft's each round; a
    # look-ahead tree (overlap) stays the model's alone
    hybrid: bool = False
    # the shortest suffix the gateway's own n-gram draft copies after (its drafter's)
    ngram_min_match: int = MIN_MATCH
    # tokens the target decodes in a row for a round that drafts nothing (VerifyCall.steps)
    decode_steps: int = 1
    # tokens each such step may verify from the target worker's own lookup (VerifyCall.lookup)
    decode_lookup: int = 0


# A plain epoch (gateway.epochs) asks for the target's own lookups while the target holds
# more than one session and fewer than its forwards' cheap rows (`WorkerInfo.lookup_rows`:
# 6 on this CPU's kernel, 16 on the AMX tile unit): beside as few decode rows a step's
# forward has rows left that cost next to nothing, which the worker's lookups fill, so the
# epochs weigh the gateway's drafts against none. 4 chat streams read 1.04-1.09 with them
# and 0.98 without; beside more rows only long-match lookups are left, which on chat at 8
# streams read 0.95-0.97 against 0.98 without (bench/RESULTS.md, "Lookups in plain
# epochs"). Alone on its target a session's plain epochs carrying lookups measured faster
# than they were worth beside the deeper trees (the same file, "Lookups in drafting epochs
# only"). A worker that does not state its rows (one from before the field) is taken to
# have this many, this CPU kernel's.
UNSTATED_LOOKUP_ROWS = 6


def plain_lookups(load: int, lookup_rows: int | None) -> bool:
    """Whether a plain epoch's rounds at a target holding `load` sessions, whose forwards
    have `lookup_rows` cheap rows (None: not stated), ask for its own lookups."""
    rows = UNSTATED_LOOKUP_ROWS if lookup_rows is None else lookup_rows
    return 1 < load < rows


# the shortest match a hybrid round's n-gram part copies after: a one-token match is
# mostly noise on open-ended text, where the model drafts better
HYBRID_MIN_NGRAM = 2


@dataclass
class PoolRoute:
    """A session's workers, from the router's pools (see the module docstring)."""

    router: Router
    metrics: Metrics
    affinity: str | None = None  # conversation key: its workers are preferred
    method: str = "auto"  # the request's drafter: auto (the deployment's), off, ngram, draft
    prefix: tuple[bytes, ...] = ()  # its prompt's routing keys (gateway.pool.prompt_blocks)
    # the method's pool, chosen once when the request starts (None: "off", or a method the
    # deployment does not have); the loop asks for it several times a round
    draft_pool: Pool | None = field(init=False)

    def __post_init__(self) -> None:
        router = self.router
        auto = self.method == "auto"
        self.draft_pool = router.drafts if auto else router.draft_pools().get(self.method)

    def pool(self, role: Role) -> Pool | None:
        return self.router.targets if role == "target" else self.draft_pool

    @property
    def drafts(self) -> bool:
        return self.draft_pool is not None

    def attempts(self, role: Role) -> int:
        return ATTEMPTS + len(self.pool(role).workers)

    def bind(self, role: Role, tried: set[str], width: int = 0) -> Worker | None:
        return self.router.bind(role, self.affinity, tried, self.pool(role), width, self.prefix)

    async def call(self, worker: Worker, tokens: int, call: Awaitable[T]) -> T:
        """Bounded by the worker's recent calls while another worker of its pool serves."""
        pool = self.router.owner(worker)
        elsewhere = any(w is not worker for w in pool.serving())
        return await worker.times.timed(call, tokens, bounded=elsewhere)

    def failed(self, worker: Worker, error: WorkerError, session_id: str) -> None:
        if isinstance(error, Hung):
            self.metrics.hung_calls.labels(worker.role).inc()
        if isinstance(error, WorkerBusy):
            self.router.unbind(worker, session_id)
        else:
            self.router.fail(worker, error, session_id)

    def resent(self, role: Role) -> None:
        self.metrics.history_resends.labels(role).inc()

    def refused(self, error: InvalidCall) -> Exception:
        return APIError(400, f"the target refused the request: {error}")

    def exhausted(self, all_busy: bool, last: WorkerError | None) -> Exception:
        retry = self.router.retry_after_s
        if all_busy:
            return APIError(429, "every target worker is busy", None, "too_many_sessions", retry)
        return APIError(503, "no healthy target worker", None, "no_healthy_target", retry)

    async def release(self, session_id: str, workers: list[Worker], keep: bool) -> None:
        """Unbinds the workers; ends the sessions on all of them at once unless kept."""
        for worker in workers:
            self.router.unbind(worker, session_id, end=False)
        if workers and not keep:
            self.router.end(session_id, workers)
        self.router.release(session_id)


class Speculation(Loop):
    """One choice of a request: the Loop over the pools, with the gateway's options."""

    def __init__(
        self,
        router: Router,
        plan: Plan,
        metrics: Metrics,
        affinity: str | None = None,
        index: int = 0,
        options: LoopOptions = LoopOptions(),
        recent: RatesByMatch | None = None,
        method: str = "auto",
        suffixes: SuffixCache | None = None,
    ):
        route = PoolRoute(
            router, metrics, affinity, method, prompt_blocks(plan.prompt, plan.cache_salt)
        )
        # a conversation keeps its sessions (and their cached prefix) for its next turn
        super().__init__(
            LoopState(plan),
            route,
            router.session_id(affinity, index),
            keep=affinity is not None,
            steps=options.decode_steps,
            lookup=options.decode_lookup if route.drafts else 0,  # speculation off: none
        )
        self.metrics = metrics
        self.options = options
        self.config = options.adaptive or AdaptiveConfig()
        self.recent = recent  # every session's rounds; a new session starts from it
        self.by_match = (recent or RatesByMatch.prior(self.config)).fresh()
        self.kind = 0  # this round's kind of estimates (gateway.adaptive.RatesByMatch)
        self.level_s = 0.0  # the draft's recent seconds per tree level (exponentially weighted)
        self.fed = 0  # tokens the last verify call fed (its history and tree, the root)
        self.outcome: VerifyOutcome | None = None  # the last verify's, with the worker's timings
        self.lookahead: Lookahead | None = None
        self.suffixes = suffixes  # other requests' outputs, for a hybrid round's n-gram part
        self.local_nodes = 0  # of this round's tree, the nodes of its n-gram part
        self.suffix = SuffixIndex()  # the history so far (`indexed`): match lengths, lookups
        self.quiet = 0  # rounds left without a draft since the target cut a whole tree
        # tokens committed since a round's draft was last accepted (`plain_steps`)
        self.unaccepted = 0
        self.may_pay: tuple[int, bool] | None = None  # `drafts_may_pay` at a history length
        self.answered: tuple[float, Worker | None] | None = None  # the last verify's: when, by
        self.cycle_s = 0.0  # seconds from the verify before to the last (0: another target's)

    # --- adaptive trees -----------------------------------------------------------------

    @property
    def adapts(self) -> bool:
        """Whether this session's trees adapt. A seeded sampling request keeps the
        configured tree: sampled output depends on the tree, and adapting it to other
        sessions' acceptance or the target's load would make the same seed give different
        text (greedy output never changes)."""
        params = self.state.plan.params
        return self.options.adaptive is not None and not params.seeded

    def shape(self, spec: TreeSpec) -> TreeSpec | None:
        if not self.adapts:
            return spec
        # the round that feeds the prompt drafts nothing: no round has measured the session
        # yet, and tree nodes would make its forward, and so its first token, later
        if self.target.held < len(self.history):
            return None
        # a target that cut the last tree whole (workers/target/runner.py fit_blocks: its
        # nodes would have opened a block of rows) is as busy as that for a while: no
        # lookup, no draft, until a probe's worth of rounds has passed; and in its plain
        # epochs (gateway.epochs) no session looks up or drafts
        if self.quiet or not self.drafting_epoch():
            return None
        kind = self.match_kind()
        if kind is None:
            return None
        self.kind = kind
        every = None if self.recent is None else self.recent[kind]  # every session's rates
        if every is not None:
            self.rates.follow(every)
        cost = self.round_cost(self.plain_steps())  # what the round would be without a draft
        return adapt(spec, self.rates, self.load, cost, self.options.adaptive, every)

    def drafting_epoch(self) -> bool:
        """Whether the bound target runs a drafting epoch now (gateway.epochs); True while
        no target is bound."""
        worker = self.target.worker
        if worker is None:
            return True
        return worker.epochs.drafting(time.perf_counter(), self.load, self.config)

    @property
    def rates(self) -> Rates:
        """The estimates of this round's kind."""
        return self.by_match[self.kind]

    def match_kind(self) -> int | None:
        """For an n-gram draft, the length of the suffix its lookup will copy after (the
        tenant's cached outputs match MAX_NGRAM tokens or more), None when nothing matches
        (the draft would be empty); 0 for any other draft, and with the overlapped loop
        (its look-ahead shapes the next round while this one is verified)."""
        if self.drafter != "ngram" or self.options.overlap:
            return 0
        plan = self.state.plan
        kind = self.indexed().match_length()
        if kind < MAX_NGRAM and self.suffixes is not None and plan.tenant is not None:
            if self.suffixes.continuations(plan.tenant, self.history, 1):
                kind = MAX_NGRAM
        return kind or None

    def indexed(self) -> SuffixIndex:
        """The history so far, indexed for prompt lookup (it only grows)."""
        self.suffix.extend(self.history[len(self.suffix) :])
        return self.suffix

    @property
    def load(self) -> int:
        return self.target.worker.load if self.target.worker else 1

    def round_cost(self, steps: int) -> RoundCost:
        """The bound target's fitted round cost plus this session's draft time per level,
        for rounds without a draft of `steps` tokens."""
        worker = self.target.worker
        if worker is None or worker.cost.weight <= 0:
            return RoundCost.prior(self.config)  # unmeasured: in token units, draft time unknown
        return replace(worker.cost.line(self.config), level_s=self.level_s, steps=steps)

    @property
    def expected_accepted(self) -> float:
        """Draft tokens of its spine a round is expected to accept, alpha / (1 - alpha), from
        recent rounds."""
        rate = min(self.rates.chain.rate, 0.99)
        return rate / (1 - rate)

    # --- the overlapped loop --------------------------------------------------------------

    async def next_tree(self) -> tuple[TokenTree, bool]:
        """The look-ahead tree when its guess came true, else a fresh propose."""
        ahead, self.lookahead = self.lookahead, None
        self.local_nodes = 0
        if ahead is None:
            return await self.propose()
        tree = await ahead.result()
        committed = self.history[ahead.base :]
        ready = None
        if isinstance(tree, Exception):  # the draft holds what it held before, or the guess
            self.draft.held = min(self.draft.held, ahead.held_before)
            if isinstance(tree, WorkerDown) and self.draft.worker is ahead.worker:
                self.leave("draft", tree, set())  # hung or gone: the fresh propose fails over
        else:  # the draft holds history[:base] + guess; keep what the outcome agrees with
            self.draft.held = ahead.base + common_prefix(ahead.guess, committed)
            ready = ahead.next_tree(tree, committed)
        if ready is not None:
            self.counters.lookahead_hits += 1
            return ready, False
        self.counters.lookahead_misses += 1
        return await self.propose()

    async def draft_tree(self, spec: TreeSpec) -> tuple[TokenTree, bool]:
        """The gateway's own n-gram draft looks its tree up in this loop's index of the
        history (kept for the rounds' match lengths) rather than through its in-process
        drafter, which would hold and index the history a second time (a few hundred µs
        a session at its first propose) for the same tree; any other draft is asked."""
        worker = self.draft.worker
        if worker is None or worker.address != LOCAL_NGRAM:
            return await super().draft_tree(spec)
        plan = self.state.plan
        index = self.indexed()
        min_match = self.options.ngram_min_match
        return lookup_tree(index, spec, self.suffixes, plan.tenant, min_match), False

    def plain_steps(self) -> int:
        """`Loop.plain_steps` once the session's drafts have gone unaccepted for twice the
        steps' tokens, or no draft would pay against rounds of steps (adaptive trees:
        `drafts_may_pay`), or its rounds of a token at a time have brought fewer tokens
        than steps would have (`gateway.adaptive.Pace`), or its target runs a plain epoch
        (`drafting_epoch`); until then a token a round, as
        text that copies its prompt gets a draft accepted every few tokens, and a round of
        steps would skip the lookups (and the copied span) of its tokens (bench/RESULTS.md,
        "Decode steps")."""
        stepping = self.stepping
        if stepping > 1 and self.route.drafts and self.unaccepted < 2 * self.steps:
            paying = self.by_match.pace.pays and self.drafting_epoch() and self.drafts_may_pay()
            return 1 if paying else stepping
        return stepping

    def lookups(self, steps: int) -> int:
        """`Loop.lookups` in its target's drafting epochs, and in its plain epochs while the
        target holds more than one session and fewer than its cheap rows (`plain_lookups`)."""
        if self.drafting_epoch() or plain_lookups(self.load, self.lookup_rows):
            return super().lookups(steps)
        return 0

    @property
    def lookup_rows(self) -> int | None:
        """The bound target's cheap rows as it states them; None while unknown."""
        worker = self.target.worker
        return worker.lookup_rows if worker is not None else None

    def drafts_may_pay(self) -> bool:
        """Whether a draft of any kind (an n-gram draft's: any match length) would beat
        decoding without one now (`gateway.adaptive.best_shape`); True with fixed trees. A
        kind the session has not drafted is weighed at every session's recent rates. Weighed
        once a round (up to three `best_shape`s, ~65 µs each here): `shape` and
        `Loop.decode_steps` both ask, and the history grows every round."""
        if self.options.adaptive is None:
            return True
        at = len(self.history)
        if self.may_pay is None or self.may_pay[0] != at:
            self.may_pay = at, self.weigh_kinds()
        return self.may_pay[1]

    def weigh_kinds(self) -> bool:
        """`drafts_may_pay`, weighed."""
        ngram = self.drafter == "ngram" and not self.options.overlap  # as `match_kind`
        kinds = range(len(self.by_match.kinds) - 1, 0, -1) if ngram else (0,)  # longest first
        cost, load, spec = self.round_cost(self.stepping), self.load, self.state.plan.spec
        for kind in kinds:
            rates = self.by_match[kind]
            if not rates.measured and self.recent is not None:
                rates = self.recent[kind]
            if best_shape(rates, load, spec, cost) != (0, 0):
                return True
        return False

    # --- hybrid trees ------------------------------------------------------------------

    def local_tree(self, spec: TreeSpec) -> TokenTree:
        """A hybrid session's n-gram part: prompt lookup over the history and the tenant's
        suffix cache, matches of HYBRID_MIN_NGRAM tokens or more; else no nodes.

        When it fills the budget the draft worker sits the round out; a feature draft
        then gets no states for that round's tokens (only the latest verify's are kept)
        and feeds them zeros (workers/draft/features.py): lower acceptance, same text."""
        if self.drafter != "hybrid":
            return TokenTree.empty()
        plan = self.state.plan
        tree = lookup_tree(self.indexed(), spec, self.suffixes, plan.tenant, HYBRID_MIN_NGRAM)
        self.local_nodes = len(tree)
        return tree

    def before_verify(self, tree: TokenTree) -> None:
        """With the overlapped loop, starts drafting the round after this one (see
        gateway.overlap): after the history plus the tree's spine, one level deeper."""
        if not self.options.overlap or not len(tree) or self.draft.worker is None:
            return
        if self.draft.worker.feature_size:  # it feeds on this verify's states: none yet
            return
        guess = spine(tree)[: round(self.expected_accepted)]
        if self.state.remaining - len(guess) - 1 <= 1:
            return  # the next round, if any, wants no draft
        spec = self.tree_spec(extra=len(guess) + 1)
        if spec is None:
            return
        budget = spec.budget  # the next round's; the look-ahead drafts its guesses of the bonus
        worker = self.draft.worker  # and a subtree under each, so it gets more room
        room = worker.max_tree_nodes or 255
        spec = replace(spec, depth=spec.depth + 1, budget=min(2 * budget + 1, room))
        held = self.draft.held
        call = self.propose_call(held, guess, spec)
        # bounded like any propose: a hung draft fails the guess, not the stream
        task = asyncio.ensure_future(self.call_propose(worker, call))
        self.lookahead = Lookahead(len(self.history), guess, held, budget, worker, task)

    async def finish(self) -> None:
        if self.lookahead is not None:
            await self.lookahead.cancel()
            self.lookahead = None

    # --- metrics, acceptance and cost ------------------------------------------------------

    async def verify(self, tree: TokenTree) -> VerifyOutcome:
        self.fed = len(self.history) - self.target.held + len(tree) + 1
        self.outcome = await super().verify(tree)
        answered, last = time.perf_counter(), self.answered
        self.answered = answered, self.target.worker
        same = last is not None and last[1] is self.target.worker
        self.cycle_s = answered - last[0] if same else 0.0
        self.cut_by_target(len(tree), self.outcome.dropped)
        return self.outcome

    def cut_by_target(self, nodes: int, dropped: int) -> None:
        """The target left the last `dropped` of the tree's `nodes` out of its forward:
        they would have opened a block of rows (workers/target/runner.py). A tree cut
        whole keeps the session from drafting for a probe's worth of rounds."""
        if not dropped:
            return
        self.metrics.dropped_draft_tokens.inc(dropped)
        if dropped == nodes:
            self.quiet = self.config.probe_every * max(1, self.load)

    @property
    def drafter(self) -> str | None:
        """What drafts the session: "ngram" (prompt lookup), "model" (a draft model),
        "feature" (an EAGLE-style head) or "hybrid" (either merged with prompt lookup);
        None: no draft."""
        worker = self.draft.worker
        if worker is None or worker.info is None:
            return None
        if worker.info.model_id == "ngram":
            return "ngram"
        if self.options.hybrid:
            return "hybrid"
        return "feature" if worker.feature_size else "model"

    def observe(self, tree: TokenTree, round_: Round) -> None:
        draft_s, verify_s = round_.seconds
        self.quiet = max(0, self.quiet - 1)
        # a draft of the gateway's accepted (the target's own lookups do not count: steps)
        self.unaccepted = 0 if round_.tree_accepted else self.unaccepted + len(round_.tokens)
        if self.route.drafts:
            self.metrics.phase["draft"].observe(draft_s)
        self.metrics.phase["verify"].observe(verify_s)
        self.observe_cost(draft_s, verify_s)
        self.observe_epoch(round_)
        path_depth = int(depths(tree.parents).max()) if len(tree) else 0
        self.observe_pace(len(tree), path_depth, round_)
        if len(tree):
            best = spine(tree)
            shape = RoundShape(path_depth, len(best), len(tree))
            on_spine = common_prefix(best, self.outcome.emitted) if self.outcome else 0
            promised = self.rates.promise(shape)
            self.rates.observe(shape, round_.accepted, on_spine, self.config)
            # a lossy rule accepts more than the draft deserves: other sessions start from
            # (and calibrate by) what exact rounds accepted
            if self.recent is not None and self.state.plan.acceptance.lossless:
                self.recent[self.kind].observe(shape, round_.accepted, on_spine, self.config)
                self.rates.calibration.observe(path_depth, promised, round_.accepted, self.config)
            # a round with n-gram nodes timed the lookup (and maybe a smaller draft call),
            # not the draft's levels of its depth
            if not round_.degraded and not self.options.overlap and not self.local_nodes:
                self.level_s += self.config.ewma * (draft_s / path_depth - self.level_s)
        self.metrics.observe_round(
            round_.drafted, round_.accepted, round_.degraded, round_.prefix_hit, round_.steps
        )
        if len(tree) and self.drafter == "hybrid":
            self.metrics.observe_hybrid(self.local_nodes, len(tree) - self.local_nodes)

    def observe_epoch(self, round_: Round) -> None:
        """A round past the session's first on the same target, of a drafting session
        whose trees adapt (`adapts`), counts towards its target's running epoch
        (gateway.epochs): its tokens and its seconds since the last verify's answer."""
        worker = self.target.worker
        if worker is None or not self.adapts or not self.route.drafts or self.cycle_s <= 0:
            return
        worker.epochs.observe(self.answered[0], self.cycle_s, len(round_.tokens))

    def observe_pace(self, nodes: int, depth: int, round_: Round) -> None:
        """A round of a token at a time (its tree's `nodes` and `depth`; 0 without a draft)
        past the session's first, where rounds without a draft may take steps and they
        would save time (the target's rounds have taught its cost their gaps: served
        workers), teaches its pace (`gateway.adaptive.Pace`) and every session's: the
        tokens it committed against the stepped tokens its modelled seconds were worth,
        both priced as the trees are (every session's round alike)."""
        stepping = self.stepping
        if (
            self.options.adaptive is None
            or stepping <= 1
            or round_.steps > 1
            or self.cycle_s <= 0
            or round_.finish_reason is not None
        ):
            return
        load, one = self.load, self.round_cost(1)
        stepped = replace(one, steps=stepping).plain(load)
        if stepped >= one.plain(load):  # steps save nothing: a lookup every token is free
            return
        par = one.seconds(load * (1 + nodes), depth) / stepped
        self.by_match.pace.observe(len(round_.tokens), par, self.config)
        if self.recent is not None and self.state.plan.acceptance.lossless:
            self.recent.pace.observe(len(round_.tokens), par, self.config)

    def observe_cost(self, draft_s: float, verify_s: float) -> None:
        """Teaches the target's cost fit this round: its batch's tokens and seconds; and,
        for a round of one forward after another round, its time outside the call's work
        and besides the forward (`RoundCost`): the seconds since the last verify's answer,
        less the draft's, less the call's work (its wall time less its wait in the
        target's queue) or the forward.

        A served worker reports the tokens its batch fed, how long the call queued and
        the forward took; an in-process one reports nothing, so the call's own tokens and
        wall time stand in, and its rounds teach no gaps.
        """
        worker, outcome = self.target.worker, self.outcome
        if worker is None or outcome is None:
            return
        timings = outcome.timings
        tokens = timings.batch_tokens or self.fed - outcome.prefix_hit
        share = 1.0 / max(1, timings.batch_size)
        work_s = verify_s - timings.queue_ns / 1e9
        worker.cost.observe(tokens, work_s, self.config, share)
        if self.cycle_s > 0 and timings.forward_ns > 0 and outcome.steps <= 1:
            round_s = self.cycle_s - draft_s
            beside_s = round_s - timings.forward_ns / 1e9
            worker.cost.observe_gaps(max(0.0, round_s - work_s), beside_s, self.config, share)

    def after_emit(self, seconds: float) -> None:
        self.metrics.phase["gateway"].observe(seconds)
