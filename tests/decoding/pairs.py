"""The one loop (workers.loop) over a tiny target and a draft, in-process or over real gRPC.

`pair(transport, target, draft)` yields a Route: "inprocess" wraps the runners in
in-process backends, "grpc" serves them as real gRPC workers on localhost
(serve_role) and reaches them through GrpcBackend. Either way the rounds are
`Loop.rounds`, the loop the gateway runs. The workers start each batch at once
(`batch_wait_ms=0`) unless a test that runs sessions side by side asks them to wait for
each other, as served workers do (workers/rpc/batcher.py).
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
from workers.protocol import TreeSpec
from workers.speculation.sampling import SamplingParams
from workers.target.runner import TargetRunner

TRANSPORTS = ["inprocess", "grpc"]
NGRAM = "ngram"


def drafter(draft: Engine | str):
    if draft == NGRAM:
        return NgramDrafter(SessionTable(8))
    return model_drafter(draft, SessionTable(draft.num_slots))


@asynccontextmanager
async def pair(
    transport: str, target: Engine, draft: Engine | str | None = None, batch_wait_ms: float = 0
):
    if transport == "inprocess":
        runner = TargetRunner(target, SessionTable(target.num_slots))
        local_target = InProcessTarget("target", runner, threaded=False)
        local_draft = None if draft is None else InProcessDraft("draft", drafter(draft), False)
        yield await Pair.of(local_target, local_draft)
        return
    async with target_worker(target, batch_wait_ms=batch_wait_ms) as (_, remote_target):
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
) -> Generation:
    return await generate(route, Plan(prompt, n, params, spec, stop_ids), uuid.uuid4().hex)
