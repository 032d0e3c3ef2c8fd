"""VerifyBatch: the Verify calls of one event-loop turn travel as one message (of the
worker's VerifyStream, or a VerifyBatch call), each answered on its own
(workers/rpc/coalesce.py)."""

import asyncio
from dataclasses import replace

import grpc
import pytest

from proto.specsplit.v1 import specsplit_pb2 as pb
from tests.engine.tiny import tiny_engine
from tests.workers.helpers import scrape, target_worker
from workers.protocol import InvalidCall, SessionLost, VerifyCall, VerifyOutcome
from workers.rpc.coalesce import Coalescer
from workers.rpc.service import WorkerServicer
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree

PROMPTS = {"a": [5, 17, 3, 88, 41], "b": list(range(20, 29)), "c": [7] * 6}
GREEDY = SamplingParams()


def start(session_id: str, prompt: list[int]) -> VerifyCall:
    return VerifyCall(session_id, 0, prompt, TokenTree.empty(), GREEDY, num_logprobs=2)


def calls_by_method(server) -> dict[tuple[str, str], float]:
    """The worker's finished calls by (method, code), those it has had only."""
    return {
        (labels["method"], labels["code"]): value
        for labels, value in scrape(server)["specsplit_worker_requests_total"]
        if value
    }


# what the worker counts for three calls made together: the stream itself is counted
# when it ends, so only its calls show while it is open
TOGETHER = {True: {}, False: {("VerifyBatch", "OK"): 1}}


@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "calls"])
async def test_calls_made_together_travel_in_one_message_and_answer_as_alone(streaming):
    async with target_worker(tiny_engine(seed=1, slots=8), streaming) as (server, target):
        calls = [start(sid, prompt) for sid, prompt in PROMPTS.items()]
        together = await asyncio.gather(*(target.verify(call) for call in calls))
        assert calls_by_method(server) == {**TOGETHER[streaming], ("Verify", "OK"): 3}
        assert (target.wire.messages, target.wire.calls) == (1, 3)
        for call, outcome in zip(calls, together, strict=True):
            alone = await target.verify(replace(call, session_id=call.session_id + "-alone"))
            assert (outcome.emitted, outcome.logprobs) == (alone.emitted, alone.logprobs)
            assert outcome.timings.batch_size == 3 and alone.timings.batch_size == 1


@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "calls"])
async def test_each_call_of_a_batch_gets_its_own_error(streaming):
    async with target_worker(tiny_engine(seed=1, slots=8), streaming) as (server, target):
        good = start("a", PROMPTS["a"])
        lost = VerifyCall("b", 4, [], TokenTree.empty(), GREEDY)  # never started
        bad = start("c", [1, 2, 500])  # a token outside the tiny vocabulary
        answers = await asyncio.gather(
            *(target.verify(call) for call in (good, lost, bad)), return_exceptions=True
        )
        assert isinstance(answers[0], VerifyOutcome)
        assert isinstance(answers[1], SessionLost)
        assert isinstance(answers[2], InvalidCall) and "vocabulary" in str(answers[2])
        assert calls_by_method(server) == {
            **TOGETHER[streaming],
            ("Verify", "OK"): 1,
            ("Verify", "NOT_FOUND"): 1,
            ("Verify", "INVALID_ARGUMENT"): 1,
        }


async def test_a_worker_without_verify_batch_is_called_one_by_one(monkeypatch):
    async def unknown(self, request, context):  # what gRPC answers a build without the method
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")

    monkeypatch.setattr(WorkerServicer, "VerifyBatch", unknown)
    async with target_worker(tiny_engine(seed=1, slots=8), streaming=False) as (server, target):
        calls = [start(sid, prompt) for sid, prompt in PROMPTS.items()]
        first = await asyncio.gather(*(target.verify(call) for call in calls))
        assert not target.calls.batching
        renamed = [replace(call, session_id=call.session_id + "2") for call in calls]
        again = await asyncio.gather(*(target.verify(call) for call in renamed))
        assert [o.emitted for o in first] == [o.emitted for o in again]
        counts = calls_by_method(server)
        assert counts[("VerifyBatch", "UNIMPLEMENTED")] == 1
        assert counts[("Verify", "OK")] == 6


async def test_a_batch_is_cancelled_once_every_caller_has_left():
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def one(request: pb.VerifyRequest) -> pb.VerifyResponse:
        raise AssertionError("two calls made together go as one batch")

    async def many(requests: list[pb.VerifyRequest]) -> list[pb.VerifyResponse]:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return []

    coalescer = Coalescer(one, many)
    callers = [
        asyncio.create_task(coalescer.call(pb.VerifyRequest(session_id=sid))) for sid in "ab"
    ]
    await asyncio.wait_for(started.wait(), 5)
    callers[0].cancel()
    await asyncio.sleep(0.01)
    assert not cancelled.is_set()  # b still waits for its answer
    callers[1].cancel()
    await asyncio.wait_for(cancelled.wait(), 5)

    async def drained() -> None:  # the ended task's done callback runs a turn later (3.12+)
        while coalescer.sending:
            await asyncio.sleep(0)

    await asyncio.wait_for(drained(), 5)


async def test_calls_decoding_several_steps_travel_apart_from_one_step_calls():
    """A message is answered once all its calls are: a one-step call made beside calls
    decoding several tokens goes in a message of its own and does not wait for them."""
    sent: list[list[tuple[str, int]]] = []

    async def one(request: pb.VerifyRequest) -> pb.VerifyResponse:
        sent.append([(request.session_id, request.steps)])
        return pb.VerifyResponse(emitted=[1])

    async def many(requests: list[pb.VerifyRequest]) -> list[pb.VerifyResponse]:
        sent.append([(r.session_id, r.steps) for r in requests])
        return [pb.VerifyResponse(emitted=[1]) for _ in requests]

    coalescer = Coalescer(one, many)
    requests = [
        pb.VerifyRequest(session_id=s, steps=n) for s, n in zip("abcd", (4, 1, 4, 0), strict=True)
    ]
    await asyncio.gather(*(coalescer.call(r) for r in requests))
    assert sorted(sent) == [[("a", 4), ("c", 4)], [("b", 1), ("d", 0)]]
