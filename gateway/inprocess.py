"""Backends that run in the gateway's own process.

`InProcessTarget` and `InProcessDraft` wrap the same runners the gRPC workers
serve (TargetRunner, ModelDrafter, NgramDrafter) and map their exceptions to
the gateway's worker errors, so the loop cannot tell them from remote workers.
Model calls run on a single-thread executor per backend: the event loop never
blocks on a forward, and calls to one engine never overlap.

Two uses:
- the in-gateway n-gram draft (`local_ngram_draft`): prompt lookup needs only
  the history the gateway already owns, so running it here saves a network
  hop per round and a process to deploy; it costs microseconds per round.
- tests: tiny models behind the real gateway, with `stop()` to simulate a
  worker dying mid-generation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from workers.draft.runner import ModelDrafter, NgramDrafter
from workers.engine.sessions import SessionTable
from workers.protocol import (
    Backend,
    InvalidCall,
    ProposeCall,
    Role,
    SessionLost,
    VerifyCall,
    VerifyOutcome,
    WorkerBusy,
    WorkerDown,
    WorkerInfo,
)
from workers.speculation.tree import TokenTree
from workers.target.runner import TargetRunner

T = TypeVar("T")


def engine_info(role: Role, engine, table: SessionTable, max_tree_nodes: int) -> WorkerInfo:
    from workers.engine.loader import tokenizer_fingerprint

    tokenizer = engine.tokenizer
    fingerprint = tokenizer_fingerprint(tokenizer) if tokenizer is not None else ""
    eos = getattr(tokenizer, "eos_token_id", None)
    return WorkerInfo(
        role=role,
        model_id=engine.model_id,
        tokenizer_fingerprint=fingerprint,
        vocab_size=engine.vocab_size,
        context_length=engine.context_length,
        max_sessions=table.num_slots,
        live_sessions=len(table),
        eos_token_ids=(eos,) if eos is not None else (),
        max_tree_nodes=max_tree_nodes,
    )


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
        if isinstance(result, SessionLost):
            raise SessionLost(str(result))
        if isinstance(result, WorkerBusy):
            raise WorkerBusy(str(result))
        if isinstance(result, ValueError):
            raise InvalidCall(str(result))
        if isinstance(result, Exception):
            raise WorkerDown(f"{type(result).__name__}: {result}")
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

    def __init__(self, address: str, runner: TargetRunner):
        super().__init__(address)
        self.runner = runner

    async def propose(self, call: ProposeCall) -> TokenTree:
        raise InvalidCall("a target worker does not propose")

    async def verify(self, call: VerifyCall) -> VerifyOutcome:
        return self.unwrap((await self.run(lambda: self.runner.verify([call])))[0])

    async def end(self, session_id: str) -> None:
        await self.run(lambda: self.runner.end(session_id))

    async def info(self) -> WorkerInfo:
        runner = self.runner
        return await self.run(
            lambda: engine_info("target", runner.engine, runner.table, runner.max_tree_nodes)
        )


class InProcessDraft(InProcessWorker):
    role: Role = "draft"

    def __init__(self, address: str, drafter: ModelDrafter | NgramDrafter, threaded: bool = True):
        super().__init__(address, threaded)
        self.drafter = drafter

    async def propose(self, call: ProposeCall) -> TokenTree:
        return self.unwrap((await self.run(lambda: self.drafter.propose([call])))[0])

    async def verify(self, call: VerifyCall) -> VerifyOutcome:
        raise InvalidCall("a draft worker does not verify")

    async def end(self, session_id: str) -> None:
        await self.run(lambda: self.drafter.end(session_id))

    async def info(self) -> WorkerInfo:
        drafter = self.drafter
        if isinstance(drafter, ModelDrafter):
            return await self.run(lambda: engine_info("draft", drafter.engine, drafter.table, 0))
        return WorkerInfo("draft", "ngram", "", drafter.vocab_size or 0, 0, 0, len(drafter.table))


def local_ngram_draft(max_sessions: int) -> InProcessDraft:
    """The in-gateway prompt-lookup draft: no thread, no model, no network hop."""
    drafter = NgramDrafter(SessionTable(max_sessions))
    return InProcessDraft("gateway:ngram", drafter, threaded=False)


class InProcessFactory:
    """A BackendFactory over backends built beforehand, by address."""

    def __init__(self, backends: list[Backend]):
        self.backends = {(b.role, b.address): b for b in backends}

    def __call__(self, role: Role, address: str) -> Backend:
        try:
            return self.backends[(role, address)]
        except KeyError:
            raise ValueError(f"no in-process {role} worker named {address!r}") from None
