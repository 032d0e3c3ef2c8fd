"""The target gRPC service: Prefill / Verify batched across sessions, over a TargetRunner.

Methods are thin: request -> VerifyCall (convert) -> the batcher, which merges
the calls of all sessions into one `TargetRunner.verify` forward on the
engine thread -> VerifyOutcome -> response. Errors are raised as the runner
raises them; the interceptor in workers/rpc/errors.py maps them to status codes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from proto.specsplit.v1 import specsplit_pb2 as pb
from proto.specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from workers.engine.engine import Engine
from workers.engine.sessions import SessionTable
from workers.protocol import VerifyCall
from workers.rpc import convert
from workers.rpc.batcher import ACTIVE_S, Batcher, EngineThread
from workers.rpc.metrics import MeteredEngine, WorkerMetrics
from workers.rpc.server import WorkerServer, engine_info
from workers.target.runner import TargetRunner

if TYPE_CHECKING:
    from workers.worker import WorkerSettings

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TargetService"].full_name


def verify_cost(call: VerifyCall) -> int:
    """Tokens a call feeds, at most: what it brings plus its tree and the re-fed root."""
    return len(call.tokens) + len(call.tree) + 1


class TargetServicer(pb_grpc.TargetServiceServicer):
    def __init__(
        self,
        runner: TargetRunner,
        batcher: Batcher[VerifyCall, object],
        thread: EngineThread,
        info: convert.WorkerInfo,
    ):
        self.runner = runner
        self.batcher = batcher
        self.thread = thread
        self.info = info

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.VerifyResponse:
        outcome, timings = await self.batcher.submit(convert.prefill_call(request))
        return convert.verify_response(outcome, timings)

    async def Verify(self, request: pb.VerifyRequest, context) -> pb.VerifyResponse:
        outcome, timings = await self.batcher.submit(convert.verify_call(request))
        return convert.verify_response(outcome, timings)

    async def EndSession(self, request: pb.EndSessionRequest, context) -> pb.EndSessionResponse:
        found = await self.thread.run(self.runner.end, request.session_id)
        return pb.EndSessionResponse(found=found)

    async def Info(self, request: pb.InfoRequest, context) -> pb.InfoResponse:
        live = len(self.runner.table)
        return convert.info_to_proto(replace(self.info, live_sessions=live))


async def serve_target(engine: Engine, settings: WorkerSettings) -> WorkerServer:
    """Starts a target worker over `engine` (its slots are the session capacity)."""
    metrics = WorkerMetrics("target")
    table = SessionTable(engine.num_slots, settings.idle_timeout_s)
    runner = TargetRunner(
        MeteredEngine(engine, metrics.observe_forward), table, settings.max_tree_nodes
    )
    thread = EngineThread("target-engine")
    batcher = Batcher(
        runner.verify,
        thread,
        key=lambda call: call.session_id,
        cost=verify_cost,
        wait_s=settings.batch_wait_ms / 1000,
        max_tokens=settings.max_batch_tokens,
        on_batch=metrics.observe_batch,
        held_sessions=lambda: table.active(ACTIVE_S),
    )
    info = engine_info("target", engine, runner.max_tree_nodes)
    servicer = TargetServicer(runner, batcher, thread, info)
    return await WorkerServer.start(
        "target",
        SERVICE_NAME,
        servicer,
        pb_grpc.add_TargetServiceServicer_to_server,
        batcher,
        thread,
        table,
        metrics,
        settings.server_options(),
    )
