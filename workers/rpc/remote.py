"""Speculative decoding over gRPC workers: the SpecDecoder loop with the network in between.

Each round: propose (the draft worker's tree after the committed history),
verify (the target worker keeps the accepted path and adds its bonus token),
commit, emit. This side owns the truth, the session's full history; a worker
that lost the session (eviction, restart, another replica) answers NOT_FOUND
and is re-sent the history with base_len 0, so nothing it forgets changes
the output.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from workers.decoder import Generation
from workers.protocol import ProposeCall, SessionLost, TreeSpec, VerifyCall, WorkerBusy
from workers.rpc.client import DraftClient, TargetClient
from workers.rpc.errors import WorkerError
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree

T = TypeVar("T")


@dataclass
class Synced:
    """How much of the history one worker holds, by this side's account."""

    held: int = 0  # history tokens the worker has been sent
    resyncs: int = 0  # times it answered NOT_FOUND and was re-sent everything

    async def send(self, history: list[int], make: Callable[[int, list[int]], Awaitable[T]]) -> T:
        """make(base_len, tokens) performs the call; on NOT_FOUND it is redone from scratch."""
        try:
            result = await make(self.held, history[self.held :])
        except SessionLost:
            if self.held == 0:
                raise
            self.resyncs += 1
            result = await make(0, list(history))
        self.held = len(history)
        return result


class RemoteDecoder:
    def __init__(
        self,
        target: TargetClient,
        draft: DraftClient | None,
        spec: TreeSpec = TreeSpec(),
        stop_ids: frozenset[int] = frozenset(),
    ):
        self.target = target
        self.draft = draft
        self.spec = spec
        self.stop_ids = stop_ids
        self.resyncs = 0  # NOT_FOUND answers recovered from, over all generations

    async def rounds(
        self,
        prompt: list[int],
        max_tokens: int,
        params: SamplingParams,
        gen: Generation,
        session_id: str | None = None,
    ) -> AsyncIterator[list[int]]:
        """Yields the tokens each round emits; fills `gen` as it goes."""
        if not prompt:
            raise ValueError("the prompt is empty")
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        sid = session_id or uuid.uuid4().hex
        history = list(prompt)
        draft_side, target_side = Synced(), Synced()
        start = time.perf_counter()
        try:
            while len(gen.token_ids) < max_tokens:
                remaining = max_tokens - len(gen.token_ids)
                tree = TokenTree.empty()
                if self.draft is not None:
                    spec = replace(
                        self.spec,
                        depth=min(self.spec.depth, remaining - 1),
                        temperature=params.temperature,
                        seed=params.seed,
                    )
                    proposal = await draft_side.send(
                        history,
                        lambda base, new, spec=spec: self.draft.propose(
                            ProposeCall(sid, base, new, spec)
                        ),
                    )
                    tree = proposal.tree
                verified = await target_side.send(
                    history,
                    lambda base, new, tree=tree: self.target.verify(
                        VerifyCall(sid, base, new, tree, params)
                    ),
                )
                outcome = verified.outcome
                history.extend(outcome.emitted)
                target_side.held = len(history)  # the target committed what it emitted
                stats = gen.stats
                stats.draft_tokens += len(tree)
                stats.accepted_tokens += len(outcome.accepted)
                stats.verify_steps += 1
                stats.emitted_tokens += len(outcome.emitted)
                emitted = outcome.emitted[:remaining]
                stop = next((i for i, t in enumerate(emitted) if t in self.stop_ids), None)
                if stop is not None:
                    emitted, gen.finish_reason = emitted[: stop + 1], "stop"
                gen.token_ids.extend(emitted)
                stats.elapsed_s = time.perf_counter() - start
                yield emitted
                if stop is not None:
                    return
        finally:
            self.resyncs += draft_side.resyncs + target_side.resyncs
            for client in (self.target, self.draft):
                if client is not None:
                    with contextlib.suppress(SessionLost, WorkerBusy, WorkerError):
                        await client.end_session(sid)

    async def generate(
        self, prompt: list[int], max_tokens: int, params: SamplingParams, session_id=None
    ) -> Generation:
        gen = Generation()
        async for _ in self.rounds(prompt, max_tokens, params, gen, session_id):
            pass
        return gen
