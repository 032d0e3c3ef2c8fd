"""The loop sends round k+1's verify before its consumer takes round k, and drops that round
when the consumer stops early: the loop the gateway runs, over a real gRPC target and the
gateway's own n-gram draft (in-process, no thread, as `make run` has it)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from tests.decoding.test_greedy_lossless import target_only
from tests.engine.tiny import tiny_engine
from tests.workers.helpers import target_worker
from workers.loop import Loop, LoopState, Pair, Plan
from workers.loop.inprocess import local_ngram_draft
from workers.protocol import Backend, TreeSpec, VerifyCall, VerifyOutcome
from workers.speculation.sampling import SamplingParams

PROMPT = [5, 17, 3, 88, 41, 5, 17, 3, 88]


@dataclass
class Counted:
    """A backend that counts the verifies it was asked for before passing them on."""

    backend: Backend
    verifies: list[int] = field(default_factory=list)  # each call's history length

    @property
    def address(self) -> str:
        return self.backend.address

    async def verify(self, call: VerifyCall) -> VerifyOutcome:
        self.verifies.append(call.base_len + len(call.tokens))
        return await self.backend.verify(call)

    def __getattr__(self, name: str):
        return getattr(self.backend, name)


async def test_each_rounds_successor_is_sent_before_the_consumer_takes_it():
    async with target_worker(tiny_engine(seed=0, slots=2)) as (_, target):
        counted = Counted(target)
        route = await Pair.of(counted, local_ngram_draft(4))
        plan = Plan(PROMPT, 24, SamplingParams(), TreeSpec(depth=3, budget=6))
        loop = Loop(LoopState(plan), route, "s")
        taken, generated = 0, []
        async with contextlib.aclosing(loop.rounds()) as rounds:
            async for round_ in rounds:
                taken += 1
                generated += round_.tokens
                if round_.finish_reason is not None:
                    assert len(counted.verifies) == taken
                    continue
                # every round but the last has its successor's verify out, and only that one,
                # which sends the history up to the end of this round
                assert len(counted.verifies) == taken + 1
                assert counted.verifies[-1] == len(PROMPT) + len(generated)
        assert generated == await target_only(0, PROMPT, 24)


async def test_a_consumer_that_stops_gets_nothing_after_and_the_round_ahead_is_dropped():
    draft = local_ngram_draft(4)
    async with target_worker(tiny_engine(seed=0, slots=2)) as (_, target):
        route = await Pair.of(target, draft)
        plan = Plan(PROMPT, 24, SamplingParams(), TreeSpec(depth=3, budget=6))
        loop = Loop(LoopState(plan), route, "s")
        generated = []
        async with contextlib.aclosing(loop.rounds()) as rounds:
            async for round_ in rounds:
                generated += round_.tokens
                if len(generated) >= 4:
                    break
        assert generated == (await target_only(0, PROMPT, 24))[: len(generated)]
        for _ in range(20):  # the dropped round's task ends; the sessions are ended
            await asyncio.sleep(0.05)
            if (await target.info()).live_sessions == 0:
                break
        assert (await target.info()).live_sessions == 0
        assert (await draft.info()).live_sessions == 0
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert not [t for t in pending if "run_round" in repr(t.get_coro())]
