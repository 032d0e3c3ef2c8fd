"""The one speculation loop: propose -> verify -> commit -> emit, over two Backends.

A `Route` says which worker serves each role of the session and what a
failure does; a `Seat` is the session's place on one worker and how much of
the history that worker holds (`held`): each call sends base_len = held and
only the tokens after it. When the worker lost the session (`SessionLost`)
or the session moves to another worker, held drops to 0 and the call
re-sends the whole history. A round's tokens join the history only after a
verify returned them, so a call that fails commits nothing: the same round
is asked again, of the same or another target, and no token is lost or
repeated.

Failures, by role:
- draft: SessionLost -> re-send to it; down or busy -> the next worker the
  route offers; refused as malformed or none left -> the target decodes
  alone this round (a degraded round: a draft never changes the output).
- target: SessionLost -> re-send to it; down or busy -> the next worker the
  route offers; refused as malformed -> `Route.refused`; none left ->
  `Route.exhausted`.
Every propose and verify goes through `Route.call`, which may bound it: the
gateway cancels a call that hangs and fails it as WorkerDown, so a hang
fails over like a crash (gateway/hangs.py).

`Pair` is the route over one fixed draft and target (`specsplit generate`,
the benchmarks, the tests); the gateway's route pools workers and fails
over (gateway/speculation.py), and its subclass of `Loop` sizes trees to
acceptance and load, drafts ahead and merges its own n-gram draft into the
draft worker's trees through the hooks `shape`, `next_tree`, `local_tree`,
`before_verify`, `observe` and `after_emit`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Protocol, TypeVar

from workers.loop.state import Generation, LoopState, Plan, Round
from workers.protocol import (
    Backend,
    Features,
    InvalidCall,
    ProposeCall,
    Role,
    SessionLost,
    TreeSpec,
    VerifyCall,
    VerifyOutcome,
    WorkerBusy,
    WorkerError,
)
from workers.speculation.tree import TokenTree, merge_trees

log = logging.getLogger("specsplit.loop")

ATTEMPTS = 4  # calls per round and role before giving up (plus one per worker offered)
# turns of the event loop a round waits before going to the consumer (`Loop.rounds`): the
# next round's task takes one to reach its verify (two when a hang bound wraps the call in
# a task), the Coalescer one to flush and one to start its call, grpc.aio one to start the
# RPC; two to spare
SEND_TURNS = 6

T = TypeVar("T")


class Placed(Protocol):
    """A worker a route offers: its backend and what the loop needs to know of it."""

    address: str
    backend: Backend
    max_tree_nodes: int  # most nodes it verifies in one tree; 0 = no limit stated
    load: int  # sessions bound to it now
    # a target: the width of the states it returns (0: not stated); a feature draft: the
    # width of the target states it feeds on; any other draft: 0
    feature_size: int


@dataclass
class Seat:
    """A session's place on one worker."""

    worker: Placed | None = None
    held: int = 0  # history tokens the worker holds for the session; 0 = send it all


class Route(Protocol):
    """Which workers serve one session, and what the loop does when a call fails."""

    drafts: bool  # whether the session drafts at all

    def attempts(self, role: Role) -> int:
        """Calls one round may make of the role before giving up."""

    def bind(self, role: Role, tried: set[str], width: int = 0) -> Placed | None:
        """A worker of the role not in `tried` (by address); None when none is left. A draft
        that feeds on states of another width than `width` (the session's target's; 0: not
        known) is passed over."""

    async def call(self, worker: Placed, tokens: int, call: Awaitable[T]) -> T:
        """Awaits a propose or verify of the worker that asks it to process `tokens` tokens."""

    def failed(self, worker: Placed, error: WorkerError, session_id: str) -> None:
        """The call failed (busy or down): stop using the worker for this session."""

    def resent(self, role: Role) -> None:
        """The worker lost the session; the next call re-sends the whole history."""

    def refused(self, error: InvalidCall) -> Exception:
        """What to raise when the target refused the call as malformed."""

    def exhausted(self, all_busy: bool, last: WorkerError | None) -> Exception:
        """What to raise when no target answered the round."""

    async def release(self, session_id: str, workers: list[Placed], keep: bool) -> None:
        """The session is over (kept: its worker sessions stay for a next turn)."""


@dataclass
class Loop:
    state: LoopState
    route: Route
    session_id: str
    keep: bool = False  # a clean end keeps the worker sessions (a conversation's next turn)
    # tokens the target decodes in a row for a round that drafts nothing (`decode_steps`)
    steps: int = 1
    # tokens each of those steps may verify from the target worker's own lookup (`lookups`;
    # the gateway's speculating sessions: --decode-lookup)
    lookup: int = 0
    draft: Seat = field(default_factory=Seat)
    target: Seat = field(default_factory=Seat)
    # the target's states of the positions its latest verify committed, asked for while the
    # session's draft is a feature draft; the next propose passes them on. Only the latest
    # round's: a draft that lost the session starts over from them (workers/draft/features.py)
    features: Features | None = None

    @property
    def history(self) -> list[int]:
        return self.state.history

    @property
    def counters(self):
        return self.state.counters

    async def rounds(self) -> AsyncIterator[Round]:
        """Runs rounds until a stop token or max_tokens; yields each round's tokens.

        Round k+1 starts (its propose and verify) as soon as round k is committed, before
        round k goes to the consumer, so the consumer's work on it (the gateway
        detokenizes, formats and streams it) overlaps the target's next forward instead of
        delaying it: a target batches the rounds of its sessions and starts a forward once
        every session of the last one has sent its next verify, and the gateway runs all of
        its sessions on one thread, so S sessions' streaming would otherwise sit between
        every two forwards. The consumer waits `SEND_TURNS` turns of the event loop first,
        long enough for every session woken by the same forward to send its verify. At most
        one round runs ahead; when the consumer stops (a stop string, a client gone), it is
        cancelled, or its tokens are committed but never yielded: either way nothing it did
        reaches the client, and the worker's copy of the session is only a cache (a next
        turn re-sends its history).
        """
        clean = False  # ended by its last round or closed by its consumer (not failed)
        ahead: asyncio.Task[Round] | None = None
        try:
            round_ = await self.run_round()
            while True:
                if self.state.finish_reason is None:
                    ahead = asyncio.ensure_future(self.run_round())
                    for _ in range(SEND_TURNS):
                        await asyncio.sleep(0)
                given = time.perf_counter()
                yield round_
                self.after_emit(time.perf_counter() - given)
                if ahead is None:
                    break
                round_, ahead = await ahead, None
            clean = True
        except GeneratorExit:
            clean = True
            raise
        finally:
            if ahead is not None:
                discard(ahead)
            await self.close(keep=clean and self.keep)

    async def run_round(self) -> Round:
        """One round: propose, verify, commit; the round carries its two calls' seconds."""
        start = time.perf_counter()
        tree, degraded = await self.next_tree()
        proposed = time.perf_counter()
        self.before_verify(tree)
        outcome = await self.verify(tree)
        verified = time.perf_counter()
        tree = tree.head(len(tree) - outcome.dropped)  # what the target verified of it
        round_ = self.state.commit(tree, outcome, degraded, (proposed - start, verified - proposed))
        self.observe(tree, round_)
        return round_

    # --- hooks (the gateway overrides them) --------------------------------------------

    def shape(self, spec: TreeSpec) -> TreeSpec | None:
        """This round's tree before fitting; None: no draft this round."""
        return spec

    async def next_tree(self) -> tuple[TokenTree, bool]:
        """The round's tree, and whether the round is degraded (no draft answered)."""
        return await self.propose()

    def local_tree(self, spec: TreeSpec) -> TokenTree:
        """Draft nodes made without the draft worker, merged first into its tree (within
        `spec`'s budget); the empty tree: none."""
        return TokenTree.empty()

    def before_verify(self, tree: TokenTree) -> None:
        """Called with the tree just before it is verified."""

    def observe(self, tree: TokenTree, round_: Round) -> None:
        """Called with each committed round and its tree."""

    def after_emit(self, seconds: float) -> None:
        """Called with the time the consumer took over a round (the next one runs
        meanwhile)."""

    async def finish(self) -> None:
        """Called once the rounds are over, before the workers are released."""

    # --- the calls --------------------------------------------------------------------

    def decode_steps(self, tree: TokenTree) -> int:
        """Tokens the target decodes in a row this round, one forward each, before it
        answers (VerifyCall.steps): up to `steps` for a round without a draft past the
        session's first (never more than are still wanted), else 1. The first round
        answers with its first token at once; a feature draft wants the target's states
        after every token; and a seeded sampled session that drafts keeps a token a
        round: its text depends on where its trees hang, and where a round of steps ends
        depends on the worker's forwards (workers/target/runner.py), which the seed does
        not fix (without a draft, each token is its position's draw either way)."""
        if len(tree) or self.target.held < len(self.history):
            return 1
        return max(1, min(self.plain_steps(), self.state.remaining))

    def lookups(self, steps: int) -> int:
        """Tokens each decode step of a round of `steps` may verify from the target's own
        prompt lookup (VerifyCall.lookup): `lookup` for an exact session, greedy or sampled
        without a seed (a step's room for them depends on the batch beside it)."""
        plan = self.state.plan
        if steps <= 1 or plan.params.seeded or not plan.acceptance.lossless:
            return 0
        return self.lookup

    def plain_steps(self) -> int:
        """The steps a round of this session without a draft takes now (`decode_steps`);
        the gateway keeps a token a round while its drafts pay."""
        return self.stepping

    @property
    def stepping(self) -> int:
        """The steps a round of this session without a draft may take (`decode_steps`)."""
        if self.steps <= 1 or (self.draft.worker is not None and self.draft.worker.feature_size):
            return 1
        if self.route.drafts and self.state.plan.params.seeded:
            return 1
        return self.steps

    def tree_spec(self, extra: int = 0) -> TreeSpec | None:
        """This round's tree: shaped, no deeper than wanted, within the target's limit."""
        if not self.route.drafts:
            return None
        spec = self.shape(self.state.plan.spec)
        if spec is None:
            return None
        limit = self.target.worker.max_tree_nodes if self.target.worker else 0
        return self.state.fit(spec, limit, extra)

    async def propose(self) -> tuple[TokenTree, bool]:
        """The round's tree after the history, and whether the round is degraded.

        The tree is `local_tree`'s (none by default) merged with the draft worker's, which
        is asked only for the nodes the local tree leaves of the budget; when the local
        tree fills it, or the draft fails, the local tree goes alone."""
        if not self.route.drafts:
            return TokenTree.empty(), False
        if self.target.worker is None:  # bound first: the tree must fit its limits
            self.bind("target", set())
        if self.draft.worker is None:  # and the draft: the local tree depends on its kind
            self.bind("draft", set())
        spec = self.tree_spec()
        if spec is None:
            return TokenTree.empty(), False
        local = self.local_tree(spec)
        if not len(local):
            return await self.draft_tree(spec)
        if len(local) >= spec.budget:
            return local, False
        drafted, _ = await self.draft_tree(replace(spec, budget=spec.budget - len(local)))
        return merge_trees(local, drafted, spec.budget), False

    def propose_call(
        self, held: int, guess: list[int], spec: TreeSpec, features: Features | None = None
    ) -> ProposeCall:
        """A propose of the history past `held` (what the draft holds), then `guess`."""
        plan = self.state.plan
        tokens = self.history[held:] + guess
        return ProposeCall(
            self.session_id, held, tokens, spec, plan.tenant, features, plan.cache_salt
        )

    def call_propose(self, worker: Placed, call: ProposeCall) -> Awaitable[TokenTree]:
        """The worker's propose, through the route (bounded as its hang rule says); its
        work is the tokens sent and the tree's nodes."""
        work = len(call.tokens) + call.spec.budget
        return self.route.call(worker, work, worker.backend.propose(call))

    async def draft_tree(self, spec: TreeSpec) -> tuple[TokenTree, bool]:
        """The draft worker's tree within `spec`, and whether none answered."""
        tried: set[str] = set()
        for _ in range(self.route.attempts("draft")):
            worker = self.draft.worker or self.bind("draft", tried)
            if worker is None:
                break
            if worker.feature_size and self.features is None:
                return TokenTree.empty(), False  # a feature draft waits for the target's states
            features = self.features if worker.feature_size else None
            call = self.propose_call(self.draft.held, [], spec, features)
            try:
                tree = await self.call_propose(worker, call)
            except SessionLost as error:
                self.resend("draft", error, tried)
                continue
            except InvalidCall as error:  # the draft refuses this session: go without it
                log.warning("draft %s refused %s: %s", worker.address, self.session_id, error)
                return TokenTree.empty(), True
            except WorkerError as error:  # down or busy: another draft
                self.leave("draft", error, tried)
                continue
            self.draft.held = len(self.history)
            return tree, False
        return TokenTree.empty(), True

    async def verify(self, tree: TokenTree) -> VerifyOutcome:
        """The target's verdict on the tree, from whichever target can give it."""
        tried: set[str] = set()
        all_busy, last = True, None
        plan = self.state.plan
        wants_features = bool(self.draft.worker and self.draft.worker.feature_size)
        for _ in range(self.route.attempts("target")):
            worker = self.target.worker or self.bind("target", tried)
            if worker is None:
                break
            held = self.target.held
            call = VerifyCall(
                self.session_id,
                held,
                self.history[held:],
                tree,
                plan.params,
                plan.num_logprobs,
                plan.acceptance,
                wants_features,
                plan.cache_salt,
                steps := self.decode_steps(tree),
                tuple(plan.stop_ids),
                lookup := self.lookups(steps),
                self.state.remaining if lookup else 0,
            )
            try:
                work = len(call.tokens) + len(tree) + call.steps - 1
                outcome = await self.route.call(worker, work, worker.backend.verify(call))
            except SessionLost as error:
                self.resend("target", error, tried)
                continue
            except InvalidCall as error:
                raise self.route.refused(error) from error
            except WorkerError as error:
                all_busy &= isinstance(error, WorkerBusy)
                last = error
                self.leave("target", error, tried)
                continue
            self.target.held = len(self.history) + len(outcome.emitted)
            self.features = outcome.hidden
            return outcome
        raise self.route.exhausted(bool(tried) and all_busy, last)

    # --- seats --------------------------------------------------------------------------

    def seat(self, role: Role) -> Seat:
        return self.draft if role == "draft" else self.target

    def bind(self, role: Role, tried: set[str]) -> Placed | None:
        """Binds the session to a new worker of the role, which holds nothing of it yet."""
        target = self.target.worker
        width = target.feature_size if role == "draft" and target is not None else 0
        worker = self.route.bind(role, tried, width)
        if worker is not None:
            seat = self.seat(role)
            seat.worker, seat.held = worker, 0
        return worker

    def resend(self, role: Role, error: SessionLost, tried: set[str]) -> None:
        """The worker lost the session: the next call re-sends the whole history."""
        seat = self.seat(role)
        if seat.held == 0:  # lost a session it was just given: treat it as broken
            self.leave(role, error, tried)
            return
        seat.held = 0
        self.counters.history_resends += 1
        self.route.resent(role)

    def leave(self, role: Role, error: WorkerError, tried: set[str]) -> None:
        """Drops a worker that failed; the next call binds another one."""
        seat = self.seat(role)
        tried.add(seat.worker.address)
        if not isinstance(error, WorkerBusy):
            self.counters.failovers += 1
        self.route.failed(seat.worker, error, self.session_id)
        seat.worker, seat.held = None, 0

    async def close(self, keep: bool) -> None:
        await self.finish()
        workers = [s.worker for s in (self.draft, self.target) if s.worker is not None]
        self.draft, self.target = Seat(), Seat()
        await self.route.release(self.session_id, workers, keep)


def discard(task: asyncio.Task) -> None:
    """Drops a round that will not be taken: cancelled if running, else its error (if any)
    retrieved. Not awaited: a cancelled request's every await raises again (anyio's cancel
    scopes), and the session must still be released after it."""
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()


# --- one fixed draft and target ---------------------------------------------------------


@dataclass
class Fixed:
    """A worker of a `Pair`."""

    backend: Backend
    max_tree_nodes: int = 0
    load: int = 0
    feature_size: int = 0

    @property
    def address(self) -> str:
        return self.backend.address


@dataclass
class Pair:
    """The route over one target and at most one draft: no pool, so no failover."""

    target: Fixed
    draft: Fixed | None = None

    @classmethod
    async def of(cls, target: Backend, draft: Backend | None = None) -> Pair:
        """Asks the target for its tree limit and the draft whether it feeds on features, once."""
        info = await target.info()
        if draft is None:
            return cls(Fixed(target, info.max_tree_nodes))
        features = (await draft.info()).feature_size
        return cls(Fixed(target, info.max_tree_nodes), Fixed(draft, feature_size=features))

    @property
    def drafts(self) -> bool:
        return self.draft is not None

    def attempts(self, role: Role) -> int:
        return ATTEMPTS + 1

    def bind(self, role: Role, tried: set[str], width: int = 0) -> Fixed | None:
        worker = self.target if role == "target" else self.draft
        if worker is None or worker.address in tried:
            return None
        return worker

    async def call(self, worker: Placed, tokens: int, call: Awaitable[T]) -> T:
        return await call  # one target: nowhere else to go, so a slow call is waited for

    def failed(self, worker: Placed, error: WorkerError, session_id: str) -> None:
        log.warning("%s failed for %s: %s", worker.address, session_id, error)

    def resent(self, role: Role) -> None:
        pass

    def refused(self, error: InvalidCall) -> Exception:
        return error

    def exhausted(self, all_busy: bool, last: WorkerError | None) -> Exception:
        return last or RuntimeError("the target gave no answer")

    async def release(self, session_id: str, workers: list[Placed], keep: bool) -> None:
        if keep:
            return
        for worker in (self.target, self.draft):
            if worker is not None:
                with contextlib.suppress(WorkerError):
                    await worker.backend.end(session_id)


async def generate(
    route: Route,
    plan: Plan,
    session_id: str,
    on_round: Callable[[Round, float], None] | None = None,
    steps: int = 1,
    lookup: int = 0,
) -> Generation:
    """Runs the loop to the end and returns the whole generation; `on_round` is called with
    each committed round and the seconds since the previous one (or the start); `steps`
    and `lookup`: `Loop.steps` and `Loop.lookup`."""
    loop = Loop(LoopState(plan), route, session_id, steps=steps, lookup=lookup)
    start = last = time.perf_counter()
    async with contextlib.aclosing(loop.rounds()) as rounds:
        async for round_ in rounds:
            if on_round is not None:
                now = time.perf_counter()
                on_round(round_, now - last)
                last = now
    state = loop.state
    elapsed = time.perf_counter() - start
    return Generation(state.generated, state.finish_reason or "length", state.counters, elapsed)
