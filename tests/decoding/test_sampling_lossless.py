"""Sampling through the whole pipeline (engines, sampled draft tree, verification, and the
one loop the gateway runs, in-process and over real gRPC workers) gives exactly the
target's distribution: a chi-square test on a tiny vocabulary. In bfloat16 the target is
the same engine in bfloat16 (its linear layers on SpecSplit's kernel on a CPU), so the
expected distribution is that engine's own, target only."""

import asyncio
import itertools

import pytest
import torch
from scipy.stats import chisquare

from tests.decoding.pairs import pair, run
from tests.engine.tiny import tiny_hf_model
from workers.engine.batch import SlotInput
from workers.engine.engine import Engine, EngineConfig
from workers.protocol import TreeSpec
from workers.speculation.sampling import SamplingParams, target_probs

VOCAB = 6
PROMPT = [1, 4, 2]
RUNS = 2000
CONCURRENT = 16  # generations in flight at once: the workers batch them, as under load


def exact_two_token_distribution(hf, params: SamplingParams) -> torch.Tensor:
    """P(t1, t2 | prompt) under the target, with the request's sampling transforms."""
    probs = torch.zeros(VOCAB, VOCAB)
    with torch.no_grad():
        first = target_probs(hf(torch.tensor([PROMPT])).logits[0, -1], params)  # (V,)
        for t1 in range(VOCAB):
            logits = hf(torch.tensor([PROMPT + [t1]])).logits[0, -1]
            probs[t1] = first[t1] * target_probs(logits, params)  # (V,)
    return probs


def engine_two_token_distribution(engine: Engine, params: SamplingParams) -> torch.Tensor:
    """P(t1, t2 | prompt) under the engine alone, target only (its own dtype's numbers)."""
    chain = list(range(-1, len(PROMPT) - 1))
    probs = torch.zeros(VOCAB, VOCAB)
    first = target_probs(engine.forward([SlotInput(0, 0, chain, PROMPT)])[0][-1], params)
    for t1 in range(VOCAB):
        logits = engine.forward([SlotInput(0, len(PROMPT), [-1], [t1])])[0][-1]  # (V,)
        probs[t1] = first[t1] * target_probs(logits, params)
    return probs


def engines(dtype: torch.dtype) -> tuple[Engine, Engine]:
    config = EngineConfig(max_sessions=CONCURRENT, max_seq_len=64)
    target = Engine.from_hf(tiny_hf_model(vocab=VOCAB, seed=4).to(dtype), None, config, "target")
    draft = Engine.from_hf(perturbed_draft_small().to(dtype), None, config, "draft")
    return target, draft


async def sampled_counts(
    transport: str, params: SamplingParams, tree: TreeSpec, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    target, draft = engines(dtype)
    counts = torch.zeros(VOCAB, VOCAB)

    async def one(seed: int) -> list[int]:
        seeded = SamplingParams(params.temperature, params.top_p, params.top_k, seed=seed)
        return (await run(route, PROMPT, 3, tree, seeded)).token_ids

    async with pair(transport, target, draft, concurrent=True) as route:
        for first in range(0, RUNS, CONCURRENT):
            seeds = range(first, min(first + CONCURRENT, RUNS))
            for out in await asyncio.gather(*(one(seed) for seed in seeds)):
                counts[out[0], out[1]] += 1
    return counts


def perturbed_draft_small():
    """A deliberately poor draft: the target's weights under heavy noise."""
    hf = tiny_hf_model(vocab=VOCAB, seed=4)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return hf


SAMPLED = SamplingParams(temperature=1.0)
TRUNCATED = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)


# over gRPC one case: 2,000 generations through real workers, 16 at a time
@pytest.mark.parametrize(
    "transport, params, tree",
    [
        ("inprocess", SAMPLED, TreeSpec(depth=2, branching=3, budget=8)),
        ("inprocess", TRUNCATED, TreeSpec(depth=2, branching=2)),
        ("grpc", SAMPLED, TreeSpec(depth=2, branching=3, budget=8)),
    ],
)
async def test_sampled_pairs_follow_the_target_distribution(transport, params, tree):
    expected = exact_two_token_distribution(tiny_hf_model(vocab=VOCAB, seed=4), params)
    counts = await sampled_counts(transport, params, tree)
    assert_follows(counts, expected)


async def test_bfloat16_sampled_pairs_follow_the_bfloat16_target_distribution():
    expected = engine_two_token_distribution(engines(torch.bfloat16)[0], SAMPLED)
    tree = TreeSpec(depth=2, branching=3, budget=8)
    counts = await sampled_counts("inprocess", SAMPLED, tree, torch.bfloat16)
    assert_follows(counts, expected)


def assert_follows(counts: torch.Tensor, expected: torch.Tensor) -> None:
    """The sampled pairs' counts against the exact distribution: chi-square, full support."""
    cells = [(a, b) for a, b in itertools.product(range(VOCAB), repeat=2) if expected[a, b] > 0]
    assert counts.sum() == RUNS
    assert sum(counts[a, b] for a, b in cells) == RUNS  # nothing outside the support
    observed = [float(counts[a, b]) for a, b in cells]
    wanted = [float(expected[a, b]) * RUNS for a, b in cells]
    scale = sum(observed) / sum(wanted)
    result = chisquare(observed, [w * scale for w in wanted])
    assert result.pvalue > 1e-3, result
