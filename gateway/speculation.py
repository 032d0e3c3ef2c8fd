"""The speculation loop of one choice: propose -> verify -> commit -> emit.

The gateway owns the truth: `history`, the prompt and every committed token.
Workers only cache it. A `Binding` remembers which worker a choice uses and
how much of the history that worker holds (`held`), so each call sends
base_len = held and only the tokens after it; after the worker lost the
session (NOT_FOUND) or when the choice moves to another worker, held drops
to 0 and the call re-sends the whole history.

A round's tokens join the history only after a verify returned them, so a
call that fails commits nothing: the same round is asked again, of the same
or another target, and no token is lost or repeated.

Failures, by role:
- draft: NOT_FOUND -> re-send to it; down or busy -> another draft; none
  left -> the target decodes alone this round (a degraded round).
- target: NOT_FOUND -> re-send to it; down -> another target with the full
  history (failover); busy -> another target; none left -> 503 (429 when
  they were all busy); refused as malformed -> 400.

Two options change how trees are made, never what is committed:
- adaptive trees (gateway.adaptive): each round's depth and budget follow
  the session's recent acceptance and the target's live sessions;
- the overlapped loop (gateway.overlap): while round k is verified, the
  draft already proposes round k+1 after the guess that round k accepts the
  tree's spine; a right guess saves the round its propose.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, fields, replace

from gateway.adaptive import Acceptance, AdaptiveConfig, adapt
from gateway.errors import APIError
from gateway.metrics import Metrics
from gateway.overlap import Lookahead
from gateway.pool import Router, Worker
from workers.engine.sessions import common_prefix
from workers.protocol import (
    InvalidCall,
    ProposeCall,
    Role,
    SessionLost,
    TokenLogprob,
    TreeSpec,
    VerifyCall,
    VerifyOutcome,
    WorkerBusy,
    WorkerError,
)
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree, depths, spine

log = logging.getLogger("specsplit.gateway")

ATTEMPTS = 4  # calls per round and role before giving up (plus one per worker in the pool)


@dataclass(frozen=True)
class LoopOptions:
    """How the loop makes trees (gateway settings); the committed tokens never depend on it."""

    adaptive: AdaptiveConfig | None = None  # None: every round proposes the plan's full tree
    overlap: bool = False  # draft round k+1 while round k is verified


@dataclass(frozen=True)
class ChoicePlan:
    """What one choice asks for, tokenized and checked."""

    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    spec: TreeSpec  # the largest tree to propose per round
    stop_ids: frozenset[int]  # tokens that end the choice (eos)
    num_logprobs: int = -1  # -1: none; k >= 0: each token's logprob and top k
    affinity: str | None = None  # conversation key (X-Session-ID or user)


@dataclass
class Round:
    tokens: list[int]  # committed this round: accepted draft tokens, then the bonus token
    logprobs: list[TokenLogprob] | None  # one per token, when asked for
    finish_reason: str | None  # "stop" (a stop token), "length" (max_tokens) or None


@dataclass
class SpecCounters:
    """Speculation counters of one choice (summed over a request's choices)."""

    draft_tokens: int = 0  # tree nodes sent to verification
    accepted_tokens: int = 0  # tree nodes the target accepted
    verify_steps: int = 0  # rounds (target forwards that committed tokens)
    emitted_tokens: int = 0  # accepted + bonus tokens
    degraded_rounds: int = 0  # rounds without a draft because none answered
    prefix_hit_tokens: int = 0  # cached prompt tokens a target reused on (re)start
    history_resends: int = 0  # full histories re-sent after NOT_FOUND
    failovers: int = 0  # moves to another worker after a failure
    lookahead_hits: int = 0  # rounds whose tree was drafted during the previous verify
    lookahead_misses: int = 0  # look-ahead trees discarded (the guess was wrong)

    def add(self, other: SpecCounters) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        rate = self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
        tau = self.emitted_tokens / self.verify_steps if self.verify_steps else 0.0
        return {**out, "acceptance_rate": round(rate, 4), "mean_accepted_length": round(tau, 4)}


@dataclass
class Binding:
    """A choice's place on one worker."""

    worker: Worker | None = None
    held: int = 0  # history tokens the worker holds for the session; 0 = send it all


@dataclass
class Speculation:
    router: Router
    plan: ChoicePlan
    metrics: Metrics
    index: int = 0  # the choice's index in its request
    options: LoopOptions = LoopOptions()
    recent: Acceptance | None = None  # every session's rounds; a new session starts from it
    history: list[int] = field(init=False)
    draft: Binding = field(default_factory=Binding)
    target: Binding = field(default_factory=Binding)
    counters: SpecCounters = field(default_factory=SpecCounters)
    finish_reason: str | None = None

    def __post_init__(self):
        self.history = list(self.plan.prompt)
        self.session_id = self.router.session_id(self.plan.affinity, self.index)
        config = self.options.adaptive or AdaptiveConfig()
        start = self.recent if self.recent is not None else Acceptance.prior(config)
        self.acceptance = replace(start, rounds_off=0)
        self.lookahead: Lookahead | None = None

    @property
    def generated(self) -> int:
        return len(self.history) - len(self.plan.prompt)

    async def rounds(self) -> AsyncIterator[Round]:
        """Runs rounds until a stop token or max_tokens; yields each round's tokens."""
        clean = False  # ended by its last round or closed by its consumer (not failed)
        try:
            while self.finish_reason is None:
                start = time.perf_counter()
                tree, degraded = await self.next_tree()
                proposed = time.perf_counter()
                self.look_ahead(tree)
                outcome = await self.verify(tree)
                verified = time.perf_counter()
                if self.router.drafts is not None:
                    self.metrics.round_phase.labels("draft").observe(proposed - start)
                self.metrics.round_phase.labels("verify").observe(verified - proposed)
                yield self.commit(tree, outcome, degraded)
                self.metrics.round_phase.labels("gateway").observe(time.perf_counter() - verified)
            clean = True
        except GeneratorExit:
            clean = True
            raise
        finally:
            if self.lookahead is not None:
                await self.lookahead.cancel()
                self.lookahead = None
            # a conversation keeps its sessions (and their cached prefix) for its next turn
            self.close(keep=clean and self.plan.affinity is not None)

    async def next_tree(self) -> tuple[TokenTree, bool]:
        """The look-ahead tree when its guess came true, else a fresh propose."""
        ahead, self.lookahead = self.lookahead, None
        if ahead is None:
            return await self.propose()
        tree = await ahead.result()
        committed = self.history[ahead.base :]
        if tree is None:  # the call failed: the draft holds what it held before, or the guess
            self.draft.held = min(self.draft.held, ahead.held_before)
        else:  # the draft holds history[:base] + guess; keep what the outcome agrees with
            self.draft.held = ahead.base + common_prefix(ahead.guess, committed)
        ready = ahead.next_tree(tree, committed) if tree is not None else None
        if ready is not None:
            self.counters.lookahead_hits += 1
            return ready, False
        self.counters.lookahead_misses += 1
        return await self.propose()

    @property
    def expected_accepted(self) -> float:
        """Draft tokens a round is expected to accept, alpha / (1 - alpha), from recent rounds."""
        rate = min(self.acceptance.rate, 0.99)
        return rate / (1 - rate)

    def look_ahead(self, tree: TokenTree) -> None:
        """With the overlapped loop, starts drafting the round after this one (see
        gateway.overlap): after the history plus the tree's spine, one level deeper."""
        if not self.options.overlap or not len(tree) or self.draft.worker is None:
            return
        guess = spine(tree)[: round(self.expected_accepted)]
        if self.plan.max_tokens - self.generated - len(guess) - 1 <= 1:
            return  # the next round, if any, wants no draft
        spec = self.tree_spec(extra=len(guess) + 1)
        if spec is None:
            return
        budget = spec.budget  # the next round's; the look-ahead drafts its guesses of the bonus
        worker = self.draft.worker  # and a subtree under each, so it gets more room
        room = worker.info.max_tree_nodes if worker.info and worker.info.max_tree_nodes else 255
        spec = replace(spec, depth=spec.depth + 1, budget=min(2 * budget + 1, room))
        held = self.draft.held
        call = ProposeCall(self.session_id, held, self.history[held:] + guess, spec)
        task = asyncio.get_running_loop().create_task(worker.backend.propose(call))
        self.lookahead = Lookahead(len(self.history), guess, held, budget, task)

    async def propose(self) -> tuple[TokenTree, bool]:
        """The draft's tree after the history, and whether the round is degraded."""
        if self.target.worker is None:  # bound first: the tree must fit its limits
            self.bind("target", set())
        spec = self.tree_spec()
        if spec is None:
            return TokenTree.empty(), False
        tried: set[str] = set()
        for _ in range(ATTEMPTS + len(self.router.drafts.workers)):
            worker = self.draft.worker or self.bind("draft", tried)
            if worker is None:
                break
            held = self.draft.held
            call = ProposeCall(self.session_id, held, self.history[held:], spec)
            try:
                tree = await worker.backend.propose(call)
            except SessionLost as error:
                self.resend(self.draft, error, tried)
                continue
            except InvalidCall as error:  # the draft refuses this session: go without it
                log.warning("draft %s refused %s: %s", worker.address, self.session_id, error)
                return TokenTree.empty(), True
            except WorkerError as error:  # down or busy: another draft
                self.leave(self.draft, error, tried)
                continue
            self.draft.held = len(self.history)
            return tree, False
        return TokenTree.empty(), True

    async def verify(self, tree: TokenTree) -> VerifyOutcome:
        """The target's verdict on the tree, from whichever target can give it."""
        tried: set[str] = set()
        all_busy = True
        for _ in range(ATTEMPTS + len(self.router.targets.workers)):
            worker = self.target.worker or self.bind("target", tried)
            if worker is None:
                break
            held = self.target.held
            call = VerifyCall(
                self.session_id,
                held,
                self.history[held:],
                tree,
                self.plan.params,
                self.plan.num_logprobs,
            )
            try:
                outcome = await worker.backend.verify(call)
            except SessionLost as error:
                self.resend(self.target, error, tried)
                continue
            except InvalidCall as error:
                raise APIError(400, f"the target refused the request: {error}") from error
            except WorkerError as error:
                all_busy &= isinstance(error, WorkerBusy)
                self.leave(self.target, error, tried)
                continue
            self.target.held = len(self.history) + len(outcome.emitted)
            self.counters.prefix_hit_tokens += outcome.prefix_hit
            return outcome
        if tried and all_busy:
            raise APIError(
                429, "every target worker is busy", None, "too_many_sessions", self.retry_after
            )
        raise APIError(503, "no healthy target worker", None, "no_healthy_target", self.retry_after)

    def commit(self, tree: TokenTree, outcome: VerifyOutcome, degraded: bool) -> Round:
        """Appends the round's tokens to the history, cut at max_tokens or a stop token."""
        remaining = self.plan.max_tokens - self.generated
        tokens = outcome.emitted[:remaining]
        stop = next((i for i, t in enumerate(tokens) if t in self.plan.stop_ids), None)
        if stop is not None:
            tokens, self.finish_reason = tokens[: stop + 1], "stop"
        elif len(tokens) == remaining:
            self.finish_reason = "length"
        self.history.extend(tokens)
        c = self.counters
        c.draft_tokens += len(tree)
        c.accepted_tokens += len(outcome.accepted)
        c.verify_steps += 1
        c.emitted_tokens += len(outcome.emitted)
        c.degraded_rounds += degraded
        if len(tree):
            path_depth = int(depths(tree.parents).max())
            config = self.options.adaptive or AdaptiveConfig()
            self.acceptance.observe(len(outcome.accepted), path_depth, config)
            if self.recent is not None:
                self.recent.observe(len(outcome.accepted), path_depth, config)
        self.metrics.observe_round(len(tree), len(outcome.accepted), degraded, outcome.prefix_hit)
        logprobs = outcome.logprobs[: len(tokens)] if outcome.logprobs is not None else None
        return Round(tokens, logprobs, self.finish_reason)

    def tree_spec(self, extra: int = 0) -> TreeSpec | None:
        """This round's tree: adapted to acceptance and load when asked, no deeper than the
        tokens still wanted, within the target's limit. `extra`: tokens the round is
        drafted ahead of the history (a look-ahead)."""
        if self.router.drafts is None:
            return None
        spec = self.plan.spec
        # A seeded sampling request keeps the configured tree: sampled output depends on
        # the tree, and adapting it to other sessions' acceptance or the target's load
        # would make the same seed give different text (greedy output never changes).
        reproducible = self.plan.params.seed is not None and not self.plan.params.greedy
        if self.options.adaptive is not None and not reproducible:
            load = self.target.worker.load if self.target.worker else 1
            spec = adapt(spec, self.acceptance, load, self.options.adaptive)
            if spec is None:
                return None
        depth = min(spec.depth, self.plan.max_tokens - self.generated - extra - 1)
        budget = spec.budget
        info = self.target.worker.info if self.target.worker else None
        if info is not None and info.max_tree_nodes > 0:
            budget = min(budget, info.max_tree_nodes)
        if depth <= 0 or budget <= 0:
            return None
        params = self.plan.params
        return replace(
            spec, depth=depth, budget=budget, temperature=params.temperature, seed=params.seed
        )

    def bind(self, role: Role, tried: set[str]) -> Worker | None:
        """Binds the choice to a new worker of the role, which holds nothing of it yet."""
        worker = self.router.bind(role, self.plan.affinity, tried)
        if worker is not None:
            if role == "draft":
                self.draft = Binding(worker, 0)
            else:
                self.target = Binding(worker, 0)
        return worker

    def resend(self, binding: Binding, error: SessionLost, tried: set[str]) -> None:
        """The worker lost the session: the next call re-sends the whole history."""
        if binding.held == 0:  # lost a session it was just given: treat it as broken
            self.leave(binding, error, tried)
            return
        binding.held = 0
        self.counters.history_resends += 1
        self.metrics.history_resends.labels(binding.worker.role).inc()

    def leave(self, binding: Binding, error: WorkerError, tried: set[str]) -> None:
        """Drops a worker that failed; the next call binds another one."""
        worker = binding.worker
        tried.add(worker.address)
        if isinstance(error, WorkerBusy):
            self.router.unbind(worker, self.session_id)
        else:
            self.router.fail(worker, error, self.session_id)
            self.counters.failovers += 1
        binding.worker, binding.held = None, 0

    @property
    def retry_after(self) -> int:
        return self.router.retry_after_s

    def close(self, keep: bool) -> None:
        """Unbinds the workers; ends the sessions on both at once unless kept."""
        workers = [b.worker for b in (self.draft, self.target) if b.worker is not None]
        for worker in workers:
            self.router.unbind(worker, self.session_id, end=False)
        if workers and not keep:
            self.router.end(self.session_id, workers)
        self.router.release(self.session_id)
        self.draft, self.target = Binding(), Binding()
