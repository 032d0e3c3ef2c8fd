"""Speculation through the two gRPC services equals in-process speculation and plain greedy."""

import pytest

from tests.decoding.test_greedy_lossless import PROMPTS, perturbed_draft, target_only
from tests.engine.tiny import tiny_engine
from tests.workers.helpers import draft_worker, target_worker
from workers.decoder import SpecDecoder
from workers.draft.runner import ModelDrafter
from workers.engine.sessions import SessionTable
from workers.protocol import TreeSpec
from workers.rpc.client import check_pair
from workers.rpc.remote import RemoteDecoder
from workers.speculation.sampling import SamplingParams
from workers.target.runner import TargetRunner

GREEDY = SamplingParams()
SPEC = TreeSpec(depth=4, branching=2, budget=8)


def in_process(seed: int, prompt: list[int], n: int, params: SamplingParams) -> list[int]:
    decoder = SpecDecoder(
        TargetRunner(tiny_engine(seed=seed, slots=2), SessionTable(2)),
        ModelDrafter(perturbed_draft(seed, noise=0.01), SessionTable(2)),
        SPEC,
    )
    return decoder.generate(prompt, n, params).token_ids


async def test_model_draft_over_grpc_equals_in_process_and_greedy():
    seed = 0
    async with (
        target_worker(tiny_engine(seed=seed, slots=2)) as (_, target),
        draft_worker(perturbed_draft(seed, noise=0.01)) as (_, draft),
    ):
        check_pair(await draft.info(), await target.info())
        decoder = RemoteDecoder(target, draft, SPEC)
        for prompt in PROMPTS:
            gen = await decoder.generate(prompt, 30, GREEDY)
            assert gen.token_ids == target_only(seed, prompt, 30)
            assert gen.token_ids == in_process(seed, prompt, 30, GREEDY)
            assert gen.stats.verify_steps < 30  # the draft's trees were accepted at times
        assert decoder.resyncs == 0


async def test_ngram_draft_over_grpc_equals_greedy():
    async with (
        target_worker(tiny_engine(seed=1, slots=2)) as (_, target),
        draft_worker(None) as (_, draft),
    ):
        check_pair(await draft.info(), await target.info())  # a model-free draft pairs with any
        decoder = RemoteDecoder(target, draft, TreeSpec(depth=6, budget=12))
        for prompt in PROMPTS:
            assert (await decoder.generate(prompt, 30, GREEDY)).token_ids == target_only(
                1, prompt, 30
            )


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, seed=7)])
async def test_sampled_trees_cross_the_wire_unchanged(params):
    """With a seed, sampled speculation is reproducible; over gRPC it must draw the same
    tokens as in-process, which needs the draft's q rows to arrive bit for bit."""
    seed = 2
    async with (
        target_worker(tiny_engine(seed=seed, slots=2)) as (_, target),
        draft_worker(perturbed_draft(seed, noise=0.01)) as (_, draft),
    ):
        decoder = RemoteDecoder(target, draft, SPEC)
        for prompt in PROMPTS[:2]:
            gen = await decoder.generate(prompt, 24, params)
            assert gen.token_ids == in_process(seed, prompt, 24, params)


async def test_prefill_gives_the_first_greedy_token_with_logprobs():
    async with target_worker(tiny_engine(seed=0, slots=2)) as (_, target):
        prompt = PROMPTS[0]
        reply = await target.prefill("p", prompt, GREEDY, num_logprobs=3)
        assert reply.outcome.accepted == []
        assert reply.outcome.emitted == target_only(0, prompt, 1)
        (lp,) = reply.outcome.logprobs
        assert lp.token == reply.outcome.emitted[0] and len(lp.top) == 3
        assert lp.top[0][0] == lp.token  # greedy: the emitted token is the most likely
        assert reply.timings.batch_size == 1 and reply.timings.forward_ns > 0
        assert await target.end_session("p") is True
        assert await target.end_session("p") is False
