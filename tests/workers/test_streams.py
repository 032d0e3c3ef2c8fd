"""VerifyStream and ProposeStream: a worker's round calls as messages of one stream
(workers/rpc/stream.py), with the faults of unary calls: deadlines, a worker killed or
shutting down, an older worker."""

import asyncio
import threading
from contextlib import asynccontextmanager

import grpc
import pytest

from proto.specsplit.v1 import specsplit_pb2 as pb
from proto.specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from tests.engine.tiny import tiny_engine
from tests.workers.helpers import draft_worker, scrape, settings, target_worker
from workers.protocol import (
    InvalidCall,
    ProposeCall,
    TreeSpec,
    VerifyCall,
    VerifyOutcome,
    WorkerDown,
)
from workers.rpc import convert
from workers.rpc.client import GrpcBackend
from workers.rpc.service import WorkerServicer, merged_replies, serve_role
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree
from workers.target.runner import TargetRunner

PROMPT = (5, 17, 3, 88, 41)


def start(session_id: str) -> VerifyCall:
    return VerifyCall(session_id, 0, list(PROMPT), TokenTree.empty(), SamplingParams())


def counts(server) -> dict[tuple[str, str], float]:
    return {
        (labels["method"], labels["code"]): value
        for labels, value in scrape(server)["specsplit_worker_requests_total"]
        if value
    }


class Gate:
    """Holds the target's steps while closed (the worker looks hung); `entered` is set once a
    step waits at it."""

    def __init__(self):
        self.open = threading.Event()
        self.entered = threading.Event()

    def install(self, monkeypatch) -> None:
        verify = TargetRunner.verify

        def held(runner, calls):
            self.entered.set()
            self.open.wait(30)
            return verify(runner, calls)

        monkeypatch.setattr(TargetRunner, "verify", held)

    async def wait_entered(self) -> None:
        await asyncio.to_thread(self.entered.wait, 30)


@asynccontextmanager
async def served(port: int = 0):
    server = await serve_role("target", tiny_engine(seed=1, slots=8), settings("target", port=port))
    try:
        yield server
    finally:
        await server.shutdown(0, 0)


async def test_rounds_travel_as_messages_of_one_stream_that_ends_cleanly():
    async with served() as server:
        async with GrpcBackend("target", f"127.0.0.1:{server.port}") as target:
            for sid in "abcd":  # one after another: a message each
                assert isinstance(await target.verify(start(sid)), VerifyOutcome)
            assert target.wire.messages == 4 and target.streaming
        assert counts(server) == {("Verify", "OK"): 4, ("VerifyStream", "OK"): 1}


@pytest.mark.parametrize("merge", [True, False])
async def test_the_answers_of_one_step_come_back_in_one_reply_where_the_messages_ask(merge):
    # a window long enough that the four messages' calls make one step
    server = await serve_role(
        "target", tiny_engine(seed=1, slots=8), settings("target", batch_wait_ms=500)
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stream = pb_grpc.TargetServiceStub(channel).VerifyStream()
            for tag, sid in enumerate("abcd", 1):
                calls = [convert.verify_request(start(sid))]
                await stream.write(pb.VerifyBatchRequest(calls=calls, tag=tag, merge_replies=merge))
            await stream.done_writing()
            replies = [reply async for reply in stream]
    finally:
        await server.shutdown(0)
    assert server.batcher.batches == 1
    answered = [(r.tag, len(r.results)) for reply in replies for r in (reply, *reply.merged)]
    assert sorted(answered) == [(1, 1), (2, 1), (3, 1), (4, 1)]
    assert len(replies) == (1 if merge else 4)
    assert all(not r.merged for reply in replies for r in reply.merged)  # never nested


def test_a_merged_reply_stops_growing_at_its_size_limit_and_keeps_the_order():
    def answer(tag: int, merge: bool = True):
        response = pb.VerifyBatchResponse(tag=tag)
        response.results.add().error.details = "x" * 100  # about 100 bytes each
        return merge, response

    size = answer(9)[1].ByteSize()  # every tag here takes one byte
    answers = [answer(1), answer(2), answer(3, merge=False), answer(4), answer(5)]
    replies = merged_replies(answers, limit=2 * size)
    assert [(r.tag, [m.tag for m in r.merged]) for r in replies] == [
        (1, [2]),
        (3, []),
        (4, [5]),
    ]


async def test_a_backend_takes_each_answer_out_of_a_merged_reply():
    async with target_worker(tiny_engine(seed=1, slots=8), batch_wait_ms=500) as (server, target):

        async def after(turns: int, sid: str) -> VerifyOutcome:
            for _ in range(turns):  # a later turn: a message of its own
                await asyncio.sleep(0)
            return await target.verify(start(sid))

        outcomes = await asyncio.gather(*(after(4 * i, sid) for i, sid in enumerate("abcd")))
        assert target.wire.messages == 4 and server.batcher.batches == 1
        alone = await target.verify(start("e"))
        assert all(outcome.emitted == alone.emitted for outcome in outcomes)


async def test_a_caller_past_its_deadline_gets_worker_down_and_the_stream_goes_on(monkeypatch):
    gate = Gate()
    gate.install(monkeypatch)
    async with served() as server:
        async with GrpcBackend("target", f"127.0.0.1:{server.port}", timeout_s=0.5) as target:
            with pytest.raises(WorkerDown, match="DEADLINE_EXCEEDED"):
                await target.verify(start("a"))
            gate.open.set()  # the worker answers late: the answer is dropped
            assert isinstance(await target.verify(start("b")), VerifyOutcome)
            assert target.streaming


async def test_a_worker_shutting_down_finishes_the_message_in_flight_and_refuses_new_ones(
    monkeypatch,
):
    gate = Gate()
    gate.install(monkeypatch)
    server = await serve_role("target", tiny_engine(seed=1, slots=8), settings("target"))
    async with GrpcBackend("target", f"127.0.0.1:{server.port}") as target:
        in_flight = asyncio.create_task(target.verify(start("a")))
        await gate.wait_entered()
        stopping = asyncio.create_task(server.shutdown(grace_s=10, drain_s=0))
        while not server.interceptor.gate.refusing:
            await asyncio.sleep(0.01)
        with pytest.raises(WorkerDown, match="UNAVAILABLE"):
            await target.verify(start("b"))
        assert counts(server)[("Verify", "UNAVAILABLE")] == 1
        gate.open.set()
        assert isinstance(await in_flight, VerifyOutcome)
        await stopping


async def test_a_worker_killed_fails_its_stream_callers_at_once_and_a_new_one_is_streamed_to(
    monkeypatch,
):
    gate = Gate()
    gate.install(monkeypatch)
    async with served() as first:
        port = first.port
        async with GrpcBackend("target", f"127.0.0.1:{port}", timeout_s=60) as target:
            waiting = asyncio.create_task(target.verify(start("a")))
            await gate.wait_entered()
            await first.server.stop(0)  # the process gone: its connection drops
            with pytest.raises(WorkerDown):
                await asyncio.wait_for(waiting, 10)  # not the 60 s deadline
            gate.open.set()
            async with served(port) as second:
                outcome = None
                for _ in range(50):  # the channel reconnects within a second or two
                    try:
                        outcome = await target.verify(start("b"))
                        break
                    except WorkerDown:
                        await asyncio.sleep(0.1)
                assert isinstance(outcome, VerifyOutcome) and target.streaming
                assert counts(second)[("Verify", "OK")] == 1


async def test_a_worker_without_the_stream_gets_its_rounds_as_calls(monkeypatch):
    async def unknown(self, requests, context):  # what gRPC answers a build without it
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")

    monkeypatch.setattr(WorkerServicer, "VerifyStream", unknown)
    async with target_worker(tiny_engine(seed=1, slots=8)) as (server, target):
        calls = [start(sid) for sid in "abc"]
        answers = await asyncio.gather(*(target.verify(call) for call in calls))
        assert not target.streaming
        assert all(isinstance(answer, VerifyOutcome) for answer in answers)
        assert isinstance(await target.verify(start("d")), VerifyOutcome)
        assert counts(server) == {
            ("VerifyStream", "UNIMPLEMENTED"): 1,
            ("VerifyBatch", "OK"): 1,
            ("Verify", "OK"): 4,
        }


HISTORIES = {"a": [5, 6, 7, 5, 6, 7, 5, 6], "b": [1, 2, 3, 4, 1, 2, 3], "c": [9, 8, 9, 8, 9]}


def proposal(session_id: str, history: list[int], spec: TreeSpec = TreeSpec(depth=3)):
    return ProposeCall(session_id, 0, history, spec)


def same_tree(one, other) -> bool:
    return one.tokens.tolist() == other.tokens.tolist() and (
        one.parents.tolist() == other.parents.tolist()
    )


async def test_proposals_made_together_travel_in_one_message_and_answer_as_alone():
    async with draft_worker(None) as (server, draft):
        calls = [proposal(sid, history) for sid, history in HISTORIES.items()]
        together = await asyncio.gather(*(draft.propose(call) for call in calls))
        assert (draft.wire.messages, draft.wire.calls) == (1, 3) and draft.streaming
        for call, tree in zip(calls, together, strict=True):
            assert len(tree) > 0
            alone = await draft.propose(proposal(call.session_id + "-alone", call.tokens))
            assert same_tree(tree, alone)
        assert counts(server) == {("Propose", "OK"): 6}


async def test_each_proposal_of_a_message_gets_its_own_error():
    async with draft_worker(None, max_tree_nodes=8) as (server, draft):
        good = proposal("a", HISTORIES["a"], TreeSpec(depth=3, budget=8))
        too_big = proposal("b", HISTORIES["b"], TreeSpec(depth=4, branching=2, budget=16))
        answers = await asyncio.gather(
            draft.propose(good), draft.propose(too_big), return_exceptions=True
        )
        assert len(answers[0]) > 0
        assert isinstance(answers[1], InvalidCall)
        assert counts(server) == {("Propose", "OK"): 1, ("Propose", "INVALID_ARGUMENT"): 1}


async def test_a_draft_worker_without_the_stream_gets_its_proposals_one_call_each(monkeypatch):
    async def unknown(self, requests, context):  # what gRPC answers a build without it
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")

    monkeypatch.setattr(WorkerServicer, "ProposeStream", unknown)
    async with draft_worker(None) as (server, draft):
        calls = [proposal(sid, history) for sid, history in HISTORIES.items()]
        trees = await asyncio.gather(*(draft.propose(call) for call in calls))
        assert not draft.streaming and not draft.calls.batching
        assert all(len(tree) > 0 for tree in trees)
        assert counts(server) == {("ProposeStream", "UNIMPLEMENTED"): 1, ("Propose", "OK"): 3}
