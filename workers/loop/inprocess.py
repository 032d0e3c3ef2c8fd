"""Backends over runners in this process, and the loop over them.

`InProcessTarget` and `InProcessDraft` wrap the runners the gRPC workers
serve (TargetRunner, ModelDrafter, NgramDrafter) and raise the same
workers.protocol errors, so the loop cannot tell them from remote workers.
Model calls run on a single-thread executor per backend (`threaded`): the
event loop never blocks on a forward, and calls to one engine never overlap.

Uses:
- `LocalDecoder`: `specsplit generate`, the benchmarks and the lossless
  tests run the one loop over a target runner and a drafter in-process;
- the gateway's own n-gram draft (`local_ngram_draft`): prompt lookup needs
  only the history the gateway already owns, so running it there saves a
  network hop per round and a process to deploy (the gateway's loop looks
  its trees up in the index it keeps of that history, `LOCAL_NGRAM`; the
  drafter stands in the draft pool and answers `specsplit generate`'s loop);
- gateway tests: tiny models behind the real gateway, with `stop()` to
  simulate a worker dying mid-generation.

Nothing here imports model code: runners are passed in.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol, TypeVar

from workers.draft.ngram import MIN_MATCH, NgramDrafter
from workers.draft.suffix import SuffixCache
from workers.engine.sessions import SessionTable
from workers.loop.driver import Pair, generate
from workers.loop.state import Generation, Plan, Round
from workers.protocol import (
    UNFINISHED,
    Backend,
    InvalidCall,
    ProposeCall,
    Role,
    TreeSpec,
    VerifyCall,
    VerifyOutcome,
    WorkerDown,
    WorkerInfo,
    as_worker_error,
    check_pair,
)
from workers.speculation.acceptance import EXACT, AcceptanceRule
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree

if TYPE_CHECKING:
    from workers.engine.engine import Engine, EngineConfig
    from workers.target.runner import TargetRunner

T = TypeVar("T")


class Drafter(Protocol):
    def propose(self, calls: list[ProposeCall]) -> list[TokenTree | Exception]: ...

    def end(self, session_id: str) -> bool: ...

    def info(self) -> WorkerInfo: ...


class InProcessWorker:
    """Shared plumbing: the executor, the error mapping and a kill switch."""

    role: Role

    def __init__(self, address: str, threaded: bool = True):
        self.address = address
        self.alive = True
        self.executor = ThreadPoolExecutor(1, f"worker-{address}") if threaded else None

    async def run(self, fn: Callable[[], T]) -> T:
        if not self.alive:
            raise WorkerDown(f"worker {self.address} is stopped")
        if self.executor is None:
            result = fn()
        else:
            result = await asyncio.get_running_loop().run_in_executor(self.executor, fn)
        if not self.alive:  # stopped while the call ran: its answer is lost
            raise WorkerDown(f"worker {self.address} stopped during the call")
        return result

    @staticmethod
    def unwrap(result: T | Exception) -> T:
        """The runners return a bad call's exception in place of its result."""
        if isinstance(result, Exception):
            raise as_worker_error(result) from result
        return result

    def stop(self) -> None:
        """Simulates the worker dying: every call and health check fails from now on."""
        self.alive = False

    async def health(self) -> bool:
        return self.alive

    async def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)


class InProcessTarget(InProcessWorker):
    role: Role = "target"

    def __init__(self, address: str, runner: TargetRunner, threaded: bool = True):
        super().__init__(address, threaded)
        self.runner = runner

    async def propose(self, call: ProposeCall) -> TokenTree:
        raise InvalidCall("a target worker does not propose")

    async def verify(self, call: VerifyCall) -> VerifyOutcome:
        result = UNFINISHED
        while result is UNFINISHED:  # a long prompt, prefilled in chunks
            result = (await self.run(lambda: self.runner.verify([call])))[0]
        return self.unwrap(result)

    async def end(self, session_id: str) -> bool:
        return await self.run(lambda: self.runner.end(session_id))

    async def info(self) -> WorkerInfo:
        return await self.run(self.runner.info)


class InProcessDraft(InProcessWorker):
    role: Role = "draft"

    def __init__(self, address: str, drafter: Drafter, threaded: bool = True):
        super().__init__(address, threaded)
        self.drafter = drafter

    async def propose(self, call: ProposeCall) -> TokenTree:
        return self.unwrap((await self.run(lambda: self.drafter.propose([call])))[0])

    async def verify(self, call: VerifyCall) -> VerifyOutcome:
        raise InvalidCall("a draft worker does not verify")

    async def end(self, session_id: str) -> bool:
        return await self.run(lambda: self.drafter.end(session_id))

    async def info(self) -> WorkerInfo:
        return await self.run(self.drafter.info)


LOCAL_NGRAM = "gateway:ngram"  # the address of the gateway's own n-gram draft


def local_ngram_draft(
    max_sessions: int, suffixes: SuffixCache | None = None, min_match: int = MIN_MATCH
) -> InProcessDraft:
    """The in-gateway prompt-lookup draft: no thread, no model, no network hop; with a
    suffix cache it also drafts from each tenant's earlier outputs."""
    drafter = NgramDrafter(SessionTable(max_sessions), suffixes=suffixes, min_match=min_match)
    return InProcessDraft(LOCAL_NGRAM, drafter, threaded=False)


class InProcessFactory:
    """A BackendFactory over backends built beforehand, by address."""

    def __init__(self, backends: list[Backend]):
        self.backends = {(b.role, b.address): b for b in backends}

    def __call__(self, role: Role, address: str) -> Backend:
        try:
            return self.backends[(role, address)]
        except KeyError:
            raise ValueError(f"no in-process {role} worker named {address!r}") from None


class LocalDecoder:
    """The one loop over a target runner and a drafter in this process.

    Calls run inline (no executor): one generation at a time, as
    `specsplit generate`, the benchmarks and the tests use it.
    """

    def __init__(
        self,
        target: TargetRunner,
        drafter: Drafter | None = None,
        spec: TreeSpec = TreeSpec(),
        stop_ids: frozenset[int] = frozenset(),
        acceptance: AcceptanceRule = EXACT,
    ):
        self.target = InProcessTarget("local-target", target, threaded=False)
        self.draft = InProcessDraft("local-draft", drafter, threaded=False) if drafter else None
        self.spec = spec
        self.stop_ids = stop_ids
        self.acceptance = acceptance  # lossy only when the caller asks for it

    async def agenerate(
        self,
        prompt: list[int],
        max_tokens: int,
        params: SamplingParams,
        num_logprobs: int = -1,
        on_round: Callable[[Round, float], None] | None = None,
    ) -> Generation:
        plan = Plan(
            prompt, max_tokens, params, self.spec, self.stop_ids, num_logprobs, self.acceptance
        )
        route = await Pair.of(self.target, self.draft)
        return await generate(route, plan, uuid.uuid4().hex, on_round)

    def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        params: SamplingParams,
        on_round: Callable[[Round, float], None] | None = None,
    ) -> Generation:
        return asyncio.run(self.agenerate(prompt, max_tokens, params, on_round=on_round))


def build_local(
    target: EngineConfig,
    draft_model: str = "ngram",
    spec: TreeSpec = TreeSpec(),
    acceptance: AcceptanceRule = EXACT,
) -> tuple[LocalDecoder, Engine]:
    """Loads the target (and a model draft) and joins them; returns the decoder and target.

    `draft_model`: a model or an EAGLE head (alias, directory, .gguf, HF id), "ngram" or
    "none"."""
    from dataclasses import replace

    from workers.draft.features import model_drafter
    from workers.engine.engine import Engine
    from workers.engine.text import stop_token_ids
    from workers.target.runner import TargetRunner

    engine = Engine.load(target)
    runner = TargetRunner(engine, SessionTable(engine.num_slots))
    drafter: Drafter | None = None
    if draft_model == "ngram":
        drafter = NgramDrafter(SessionTable(1024), engine.vocab_size)
    elif draft_model != "none":
        draft = Engine.load(replace(target, model=draft_model))
        drafter = model_drafter(draft, SessionTable(draft.num_slots))
        check_pair(drafter.info(), runner.info())
    stop_ids = stop_token_ids(engine.tokenizer)
    return LocalDecoder(runner, drafter, spec, stop_ids, acceptance), engine
