"""Malformed requests get INVALID_ARGUMENT (and the like) while other sessions carry on."""

import asyncio

import grpc
import pytest

from proto.specsplit.v1 import specsplit_pb2 as pb
from proto.specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from tests.decoding.test_greedy_lossless import perturbed_draft, target_only
from tests.engine.tiny import tiny_engine
from tests.workers.helpers import draft_worker, scrape, target_worker

PROMPT = [5, 17, 3, 88, 41, 5, 17]
VOCAB = 96  # the tiny models' vocabulary
MAX_NODES = 8  # the workers' tree budget in these tests


def tree(tokens, parents, **q) -> pb.TokenTree:
    return pb.TokenTree(tokens=tokens, parents=parents, **q)


BAD_VERIFY = {
    "parent out of range": dict(tree=tree([3, 4], [-1, -2])),
    "cycle (parent after its child)": dict(tree=tree([3, 4], [1, 0])),
    "own parent": dict(tree=tree([3], [0])),
    "tree token outside the vocabulary": dict(tree=tree([VOCAB], [-1])),
    "negative tree token": dict(tree=tree([-1], [-1])),
    "history token outside the vocabulary": dict(tokens=[1, 2, 500]),
    "tree over the budget": dict(tree=tree([1] * (MAX_NODES + 1), list(range(-1, MAX_NODES)))),
    "empty history": dict(tokens=[]),
    "parents and tokens differ in length": dict(tree=tree([3, 4], [-1])),
    "q rows of the wrong size": dict(tree=tree([3], [-1], q_width=2, q_tokens=[3], q_probs=[1])),
    "q row not a distribution": dict(tree=tree([3], [-1], q_width=1, q_tokens=[3], q_probs=[0.5])),
    "top_p out of range": dict(sampling=pb.SamplingParams(top_p=1.5)),
    "negative temperature": dict(sampling=pb.SamplingParams(temperature=-1)),
    "num_logprobs below -1": dict(num_logprobs=-2),
    "history over the context": dict(tokens=[1] * 300),
    "no session id": dict(session_id=""),
}


def bad_request(case: dict, session_id: str, base_len: int = 0) -> pb.VerifyRequest:
    fields = {"tokens": [1, 2, 3], "session_id": session_id, **case}
    return pb.VerifyRequest(base_len=base_len, **fields)


async def code_of(call) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


async def test_malformed_verify_requests_are_rejected_and_others_unharmed():
    expected = await target_only(0, PROMPT, len(BAD_VERIFY) + 1)
    async with target_worker(tiny_engine(seed=0, slots=3), max_tree_nodes=MAX_NODES) as (
        server,
        client,
    ):
        stub = pb_grpc.TargetServiceStub(client.channel)
        reply = await stub.Verify(pb.VerifyRequest(session_id="ok", tokens=PROMPT))
        history = PROMPT + list(reply.emitted)
        for name, case in BAD_VERIFY.items():
            code = await code_of(stub.Verify(bad_request(case, "bad")))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, name
            # the same mistake on the live session leaves it intact
            if not {"tokens", "session_id"} & set(case):
                request = bad_request(case, "ok", base_len=len(history))
                request.ClearField("tokens")
                code = await code_of(stub.Verify(request))
                assert code == grpc.StatusCode.INVALID_ARGUMENT, name
            reply = await stub.Verify(pb.VerifyRequest(session_id="ok", base_len=len(history)))
            history += list(reply.emitted)
        assert history[len(PROMPT) :] == expected
        codes = {
            (labels["method"], labels["code"]): v
            for labels, v in scrape(server)["specsplit_worker_requests_total"]
        }
        assert codes[("Verify", "INVALID_ARGUMENT")] >= len(BAD_VERIFY)
        assert codes[("Verify", "OK")] == len(BAD_VERIFY) + 1  # the start, then one per case


async def test_invalid_argument_message_names_the_rule():
    async with target_worker(tiny_engine(seed=0)) as (_, client):
        stub = pb_grpc.TargetServiceStub(client.channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Verify(bad_request(BAD_VERIFY["cycle (parent after its child)"], "x"))
        assert "node 0: parent 1 is not an earlier node" in caught.value.details()


BAD_PROPOSE = {
    "branching 0": dict(policy=pb.TreePolicy(depth=3, branching=0, budget=4)),
    "depth over the limit": dict(policy=pb.TreePolicy(depth=MAX_NODES + 1, branching=1)),
    "budget over the limit": dict(policy=pb.TreePolicy(depth=2, branching=2, budget=100)),
    "negative temperature": dict(policy=pb.TreePolicy(depth=2, branching=1, temperature=-1)),
    "history token outside the vocabulary": dict(tokens=[1, VOCAB]),
    "empty history": dict(tokens=[]),
}


async def test_malformed_propose_requests_are_rejected():
    async with draft_worker(perturbed_draft(0, 0.01, slots=2), max_tree_nodes=MAX_NODES) as (
        _,
        client,
    ):
        stub = pb_grpc.DraftServiceStub(client.channel)
        good = pb.TreePolicy(depth=3, branching=2, budget=6)
        for name, case in BAD_PROPOSE.items():
            fields = {"tokens": PROMPT, "policy": good, **case}
            request = pb.ProposeRequest(session_id="bad", **fields)
            assert await code_of(stub.Propose(request)) == grpc.StatusCode.INVALID_ARGUMENT, name
        reply = await stub.Propose(pb.ProposeRequest(session_id="ok", tokens=PROMPT, policy=good))
        assert 0 < len(reply.tree.tokens) <= 6


async def test_unexpected_errors_are_internal_and_the_worker_keeps_serving(caplog):
    async with target_worker(tiny_engine(seed=0, slots=2)) as (server, client):
        runner = server.servicer.runner
        prepare = runner.prepare

        def broken(call, busy):
            if call.session_id == "boom":
                raise RuntimeError("a bug")
            return prepare(call, busy)

        runner.prepare = broken
        stub = pb_grpc.TargetServiceStub(client.channel)
        boom = stub.Verify(pb.VerifyRequest(session_id="boom", tokens=PROMPT))
        fine = stub.Verify(pb.VerifyRequest(session_id="fine", tokens=PROMPT))
        codes = await asyncio.gather(code_of(boom), code_of(fine))
        assert codes == [grpc.StatusCode.INTERNAL, grpc.StatusCode.OK]
        assert "a bug" in caplog.text
        reply = await stub.Verify(pb.VerifyRequest(session_id="again", tokens=PROMPT))
        assert list(reply.emitted) == await target_only(0, PROMPT, 1)


async def test_every_slot_busy_in_one_batch_is_resource_exhausted():
    # one slot, and a batch that is full (so it starts at once) only when both calls are in it
    prompts = {"s1": [1, 2, 3, 4], "s2": [5, 6, 7, 8]}
    async with target_worker(
        tiny_engine(seed=0, slots=1), batch_wait_ms=60_000, max_batch_tokens=10
    ) as (_, client):
        stub = pb_grpc.TargetServiceStub(client.channel)
        codes = await asyncio.gather(
            *(
                code_of(stub.Verify(pb.VerifyRequest(session_id=s, tokens=p)))
                for s, p in prompts.items()
            )
        )
        assert sorted(c.name for c in codes) == ["OK", "RESOURCE_EXHAUSTED"]
