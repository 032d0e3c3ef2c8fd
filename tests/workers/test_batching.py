"""Concurrent sessions on one target worker are batched and give their one-by-one outputs."""

import asyncio

from tests.decoding.pairs import run
from tests.decoding.test_greedy_lossless import perturbed_draft
from tests.engine.tiny import tiny_engine
from tests.workers.helpers import draft_worker, scrape, target_worker
from workers.loop import Pair
from workers.protocol import TreeSpec
from workers.speculation.sampling import SamplingParams

PROMPTS = [[(7 * i + 3 * j) % 96 for j in range(5 + i)] for i in range(8)]
SPEC = TreeSpec(depth=3, branching=2, budget=6)


async def test_eight_concurrent_sessions_equal_sequential_and_are_batched():
    # a wide batching window: the eight sessions' calls join one batch instead of racing
    async with (
        target_worker(tiny_engine(seed=0, slots=8), batch_wait_ms=50) as (target_server, target),
        draft_worker(perturbed_draft(0, 0.01, slots=8), batch_wait_ms=50) as (draft_server, draft),
    ):
        route = await Pair.of(target, draft)
        params = SamplingParams()
        alone = [(await run(route, p, 20, SPEC, params)).token_ids for p in PROMPTS]
        assert target_server.batcher.largest == 1  # one session at a time never batches
        together = await asyncio.gather(*(run(route, p, 20, SPEC, params) for p in PROMPTS))
        assert [g.token_ids for g in together] == alone
        assert target_server.batcher.largest > 1
        assert draft_server.batcher.largest > 1

        metrics = scrape(target_server)
        (count,) = [v for labels, v in metrics["specsplit_worker_batch_size_count"]]
        (singles,) = [
            v
            for labels, v in metrics["specsplit_worker_batch_size_bucket"]
            if labels["le"] == "1.0"
        ]
        assert count > singles  # some observed batches held more than one call
        assert all(
            labels["role"] == "target" for labels, _ in metrics["specsplit_worker_batch_size_count"]
        )
