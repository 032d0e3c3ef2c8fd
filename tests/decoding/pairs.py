"""The one loop (workers.loop) over a tiny target and a draft, in-process or over real gRPC.

`pair(transport, target, draft)` yields a Route: "inprocess" wraps the runners in
in-process backends, "grpc" serves them as real gRPC workers on localhost
(serve_role) and reaches them through GrpcBackend. Either way the rounds are
`Loop.rounds`, the loop the gateway runs.

Tests that run many sessions side by side have them share forwards as on a served worker:
in-process with `concurrent=True` (each backend queues its calls in the worker's own
`Batcher` and runs one runner step for all of them); over gRPC the workers batch anyway,
and with the served `batch_wait_ms` (SERVED_BATCH_WAIT_MS) they wait for the other
sessions' calls instead of starting each batch at once, which pays where forwards are long
(the embedded model), not on tiny ones. A seeded session's tokens do not depend on any of
this: the engine gives a row the same logits whatever rows share its forward
(tests/engine/test_batch_invariance.py).
"""

from __future__ import annotations

import uuid
from contextlib import asynccontextmanager

from tests.workers.helpers import draft_worker, target_worker
from workers.draft.features import model_drafter
from workers.draft.ngram import NgramDrafter
from workers.engine.engine import Engine
from workers.engine.sessions import SessionTable
from workers.loop import Generation, Pair, Plan, generate
from workers.loop.inprocess import InProcessDraft, InProcessTarget
from workers.protocol import ProposeCall, TreeSpec, VerifyCall, as_worker_error
from workers.rpc.batcher import Batcher
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree
from workers.target.runner import TargetRunner
from workers.worker import WorkerSettings

TRANSPORTS = ["inprocess", "grpc"]
NGRAM = "ngram"
SERVED_BATCH_WAIT_MS = WorkerSettings.model_fields["batch_wait_ms"].default


def drafter(draft: Engine | str):
    if draft == NGRAM:
        return NgramDrafter(SessionTable(8))
    return model_drafter(draft, SessionTable(draft.num_slots))


class Inline:
    """A Batcher's engine thread that is the event loop's own: a step blocks the loop, so by
    the next step every session whose call the last one answered has queued its next."""

    async def run(self, fn, *args):
        return fn(*args)


def batcher(step) -> Batcher:
    """The worker's Batcher over a runner's batched step, with nothing to wait for."""
    return Batcher(step, Inline(), key=lambda call: call.session_id, cost=lambda call: 1, wait_s=0)


async def submit(queue: Batcher, call):
    """One call through the batcher; a runner's error as the worker error it stands for."""
    try:
        result, _timings = await queue.submit(call)
    except Exception as error:
        raise as_worker_error(error) from error
    return result


class BatchedTarget(InProcessTarget):
    """An in-process target whose verify calls queue in a Batcher (the rest as inherited)."""

    def __init__(self, runner: TargetRunner):
        super().__init__("target", runner, threaded=False)
        self.queue = batcher(runner.verify)

    async def verify(self, call: VerifyCall):
        return await submit(self.queue, call)


class BatchedDraft(InProcessDraft):
    """An in-process draft whose propose calls queue in a Batcher (the rest as inherited)."""

    def __init__(self, draft):
        super().__init__("draft", draft, threaded=False)
        self.queue = batcher(draft.propose)

    async def propose(self, call: ProposeCall) -> TokenTree:
        return await submit(self.queue, call)


@asynccontextmanager
async def inprocess(target: Engine, draft: Engine | str | None, concurrent: bool):
    """In-process backends over the runners; batched ones, started and closed, if concurrent."""
    runner = TargetRunner(target, SessionTable(target.num_slots))
    if not concurrent:
        local_draft = None if draft is None else InProcessDraft("draft", drafter(draft), False)
        yield await Pair.of(InProcessTarget("target", runner, threaded=False), local_draft)
        return
    backends = [BatchedTarget(runner)] + ([] if draft is None else [BatchedDraft(drafter(draft))])
    for backend in backends:
        backend.queue.start()
    try:
        yield await Pair.of(*backends)
    finally:
        for backend in backends:
            await backend.queue.close()


@asynccontextmanager
async def pair(
    transport: str,
    target: Engine,
    draft: Engine | str | None = None,
    concurrent: bool = False,
    batch_wait_ms: float = 0,
    lookup_rows: int = -1,
):
    """`lookup_rows`: the gRPC target's (WorkerSettings.lookup_rows; -1: the engine's)."""
    if transport == "inprocess":
        async with inprocess(target, draft, concurrent) as route:
            yield route
        return
    served = target_worker(target, batch_wait_ms=batch_wait_ms, lookup_rows=lookup_rows)
    async with served as (_, remote_target):
        if draft is None:
            yield await Pair.of(remote_target)
            return
        model = None if draft == NGRAM else draft
        async with draft_worker(model, batch_wait_ms=batch_wait_ms) as (_, remote_draft):
            yield await Pair.of(remote_target, remote_draft)


async def run(
    route,
    prompt: list[int],
    n: int,
    spec: TreeSpec = TreeSpec(),
    params: SamplingParams = SamplingParams(),
    stop_ids: frozenset[int] = frozenset(),
    steps: int = 1,
    lookup: int = 0,
) -> Generation:
    plan = Plan(prompt, n, params, spec, stop_ids)
    return await generate(route, plan, uuid.uuid4().hex, steps=steps, lookup=lookup)
