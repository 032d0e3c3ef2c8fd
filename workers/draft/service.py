"""The draft gRPC service: Propose batched across sessions, over a ModelDrafter or NgramDrafter.

Methods are thin: request -> ProposeCall (convert; the tree policy is checked
against the worker's limits and fitted to the context) -> the batcher, which
hands the calls of all sessions to one `propose(calls)` on the engine thread
(the model drafter expands their trees level-synchronously, one forward per
level) -> TokenTree -> response.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from proto.specsplit.v1 import specsplit_pb2 as pb
from proto.specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from workers.draft.runner import ModelDrafter, NgramDrafter
from workers.engine.engine import Engine
from workers.engine.sessions import SessionTable
from workers.protocol import ProposeCall, TreeSpec
from workers.rpc import convert
from workers.rpc.batcher import ACTIVE_S, Batcher, EngineThread
from workers.rpc.metrics import MeteredEngine, WorkerMetrics
from workers.rpc.server import WorkerServer, engine_info

if TYPE_CHECKING:
    from workers.worker import WorkerSettings

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DraftService"].full_name


def check_spec(spec: TreeSpec, max_nodes: int) -> None:
    """Rejects policies that would make the worker do unbounded work."""
    for name in ("depth", "branching", "budget"):
        if getattr(spec, name) > max_nodes:
            raise ValueError(
                f"tree {name} {getattr(spec, name)} is over this worker's limit of {max_nodes}"
            )


def fit_spec(spec: TreeSpec, history_len: int, cache_len: int) -> TreeSpec:
    """Shrinks the depth so the tree being expanded fits in the session's cache slot.

    Expanding feeds the history's uncached tail, then at each later level at
    most `branching` nodes, so the slot holds at most
    history_len + (depth - 1) * branching entries.
    """
    room = cache_len - history_len
    depth = min(spec.depth, 1 + room // spec.branching) if room > 0 else 0
    return spec if depth == spec.depth else replace(spec, depth=depth)


def propose_cost(call: ProposeCall) -> int:
    """Tokens a call feeds, at most: what it brings plus one level of nodes per depth."""
    return len(call.tokens) + call.spec.depth * call.spec.branching + 1


class DraftServicer(pb_grpc.DraftServiceServicer):
    def __init__(
        self,
        drafter: ModelDrafter | NgramDrafter,
        batcher: Batcher[ProposeCall, object],
        thread: EngineThread,
        info: convert.WorkerInfo,
        cache_len: int = 0,
    ):
        self.drafter = drafter
        self.cache_len = cache_len  # entries per session slot; 0 = no cache (n-gram)
        self.batcher = batcher
        self.thread = thread
        self.info = info

    async def Propose(self, request: pb.ProposeRequest, context) -> pb.ProposeResponse:
        call = convert.propose_call(request)
        check_spec(call.spec, self.info.max_tree_nodes)
        if self.cache_len:
            history = call.base_len + len(call.tokens)
            call = replace(call, spec=fit_spec(call.spec, history, self.cache_len))
        tree, timings = await self.batcher.submit(call)
        return convert.propose_response(tree, timings)

    async def EndSession(self, request: pb.EndSessionRequest, context) -> pb.EndSessionResponse:
        found = await self.thread.run(self.drafter.end, request.session_id)
        return pb.EndSessionResponse(found=found)

    async def Info(self, request: pb.InfoRequest, context) -> pb.InfoResponse:
        live = len(self.drafter.table)
        return convert.info_to_proto(replace(self.info, live_sessions=live))


async def serve_draft(engine: Engine | None, settings: WorkerSettings) -> WorkerServer:
    """Starts a draft worker over `engine`, or a model-free n-gram drafter when None."""
    metrics = WorkerMetrics("draft")
    cache_len = 0
    if engine is None:
        table = SessionTable(settings.max_sessions, settings.idle_timeout_s)
        drafter: ModelDrafter | NgramDrafter = NgramDrafter(table)
        info = convert.WorkerInfo(
            role="draft",
            model_id="ngram",
            tokenizer_fingerprint="",
            vocab_size=0,
            context_length=0,
            max_sessions=settings.max_sessions,
            live_sessions=0,
            eos_token_ids=(),
            max_tree_nodes=settings.max_tree_nodes,
        )
    else:
        table = SessionTable(engine.num_slots, settings.idle_timeout_s)
        drafter = ModelDrafter(MeteredEngine(engine, metrics.observe_forward), table)
        info = engine_info("draft", engine, settings.max_tree_nodes)
        cache_len = engine.context_length + engine.max_tree_nodes
    thread = EngineThread("draft-engine")
    batcher = Batcher(
        drafter.propose,
        thread,
        key=lambda call: call.session_id,
        cost=propose_cost,
        wait_s=settings.batch_wait_ms / 1000,
        max_tokens=settings.max_batch_tokens,
        on_batch=metrics.observe_batch,
        held_sessions=lambda: table.active(ACTIVE_S),
    )
    servicer = DraftServicer(drafter, batcher, thread, info, cache_len)
    return await WorkerServer.start(
        "draft",
        SERVICE_NAME,
        servicer,
        pb_grpc.add_DraftServiceServicer_to_server,
        batcher,
        thread,
        table,
        metrics,
        settings.server_options(),
    )
