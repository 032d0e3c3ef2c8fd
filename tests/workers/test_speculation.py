"""The loop over the two gRPC services equals the loop in-process and plain greedy."""

import pytest

from tests.decoding.pairs import pair, run
from tests.decoding.test_greedy_lossless import PROMPTS, perturbed_draft, target_only
from tests.engine.tiny import tiny_engine
from tests.workers.helpers import draft_worker, target_worker
from workers.protocol import TreeSpec, VerifyCall, check_pair
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree

GREEDY = SamplingParams()
SPEC = TreeSpec(depth=4, branching=2, budget=8)


async def generations(transport: str, seed: int, n: int, params: SamplingParams):
    async with pair(transport, tiny_engine(seed=seed, slots=2), perturbed_draft(seed, 0.01)) as p:
        return [await run(p, prompt, n, SPEC, params) for prompt in PROMPTS]


async def test_model_draft_over_grpc_equals_in_process_and_greedy():
    remote = await generations("grpc", 0, 30, GREEDY)
    local = await generations("inprocess", 0, 30, GREEDY)
    for prompt, gen, same in zip(PROMPTS, remote, local, strict=True):
        assert gen.token_ids == await target_only(0, prompt, 30) == same.token_ids
        assert gen.stats.verify_steps < 30  # the draft's trees were accepted at times
        assert gen.stats.history_resends == 0


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, seed=7)])
async def test_sampled_trees_cross_the_wire_unchanged(params):
    """With a seed, sampled speculation is reproducible; over gRPC it must draw the same
    tokens as in-process, which needs the draft's q rows to arrive bit for bit."""
    remote = await generations("grpc", 2, 24, params)
    local = await generations("inprocess", 2, 24, params)
    assert [g.token_ids for g in remote] == [g.token_ids for g in local]


async def test_workers_say_whether_they_pair():
    async with (
        target_worker(tiny_engine(seed=1, slots=2)) as (_, target),
        draft_worker(None) as (_, ngram),
        draft_worker(perturbed_draft(1, 0.01)) as (_, model),
    ):
        check_pair(await ngram.info(), await target.info())  # a model-free draft pairs with any
        check_pair(await model.info(), await target.info())  # same vocabulary


async def test_a_verify_from_scratch_gives_the_first_greedy_token_with_logprobs():
    async with target_worker(tiny_engine(seed=0, slots=2)) as (_, target):
        prompt = PROMPTS[0]
        call = VerifyCall("p", 0, prompt, TokenTree.empty(), GREEDY, num_logprobs=3)
        outcome = await target.verify(call)
        assert outcome.accepted == []
        assert outcome.emitted == await target_only(0, prompt, 1)
        (lp,) = outcome.logprobs
        assert lp.token == outcome.emitted[0] and len(lp.top) == 3
        assert lp.top[0][0] == lp.token  # greedy: the emitted token is the most likely
        assert outcome.timings.batch_size == 1 and outcome.timings.forward_ns > 0
        assert await target.end("p") is True
        assert await target.end("p") is False
