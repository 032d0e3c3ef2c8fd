"""An evicted session answers NOT_FOUND, is re-sent its history, and its output is unchanged."""

import grpc
import pytest

from proto.specsplit.v1 import specsplit_pb2 as pb
from proto.specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from tests.decoding.test_greedy_lossless import target_only
from tests.engine.tiny import tiny_engine
from tests.workers.helpers import draft_worker, scrape, target_worker
from workers.loop import Loop, LoopState, Pair, Plan
from workers.protocol import SessionLost, TreeSpec, VerifyCall
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree

PROMPTS = {"a": [5, 17, 3, 88, 41], "b": list(range(20, 29)), "c": [7] * 6}
GREEDY = SamplingParams()


async def test_evicted_session_is_resent_and_output_is_unchanged():
    async with (
        target_worker(tiny_engine(seed=1, slots=2)) as (server, target),
        draft_worker(None) as (_, draft),
    ):
        route = await Pair.of(target, draft)
        spec = TreeSpec(depth=4, budget=8)
        loops = {
            sid: Loop(LoopState(Plan(p, 24, GREEDY, spec)), route, sid)
            for sid, p in PROMPTS.items()
        }
        # round robin over three sessions on two slots, one round at a time (`rounds` would
        # run each session's next round beside the others'): each round evicts another
        live = dict(loops)
        while live:
            for sid in list(live):
                await live[sid].run_round()
                if live[sid].state.finish_reason is not None:
                    await live.pop(sid).close(keep=False)
        for sid, prompt in PROMPTS.items():
            assert loops[sid].state.generated == await target_only(1, prompt, 24)
        assert sum(loop.counters.history_resends for loop in loops.values()) > 0
        (evictions,) = [v for _, v in scrape(server)["specsplit_worker_evictions_total"]]
        assert evictions > 0


async def test_an_evicted_session_answers_not_found():
    async with target_worker(tiny_engine(seed=0, slots=2)) as (_, target):
        for sid in "abc":  # c evicts a, the least recently used
            await target.verify(VerifyCall(sid, 0, PROMPTS[sid], TokenTree.empty(), GREEDY))
        n = len(PROMPTS["a"]) + 1
        with pytest.raises(SessionLost):
            await target.verify(VerifyCall("a", n, [], TokenTree.empty(), GREEDY))
        stub = pb_grpc.TargetServiceStub(target.channel)  # the raw status code
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Verify(pb.VerifyRequest(session_id="a", base_len=n))
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        # re-sent from the start, the session carries on with the tokens greedy gives
        history = PROMPTS["a"] + await target_only(0, PROMPTS["a"], 1)
        outcome = await target.verify(VerifyCall("a", 0, history, TokenTree.empty(), GREEDY))
        assert history[len(PROMPTS["a"]) :] + outcome.emitted == await target_only(
            0, PROMPTS["a"], 2
        )
