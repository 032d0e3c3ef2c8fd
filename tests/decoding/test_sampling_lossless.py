"""Sampling through the whole pipeline (engines, sampled draft tree, verification, and the
one loop the gateway runs, in-process and over real gRPC workers) gives exactly the
target's distribution: a chi-square test on a tiny vocabulary; so do decode steps that
verify the target worker's own lookups (VerifyCall.lookup), over gRPC. In bfloat16 the
target is the same engine in bfloat16 (its linear layers on SpecSplit's kernel on a CPU),
so the expected distribution is that engine's own, target only."""

import asyncio
import itertools
from dataclasses import replace

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


def exact_distribution(
    hf, params: SamplingParams, prompt: list[int] = PROMPT, n: int = 2
) -> torch.Tensor:
    """P(t1, ..., tn | prompt) under the target, with the request's sampling transforms,
    (V,) * n: every path fed whole."""
    probs = torch.zeros((VOCAB,) * n)
    with torch.no_grad():
        for path in itertools.product(range(VOCAB), repeat=n - 1):
            logits = hf(torch.tensor([prompt + list(path)])).logits[0]  # (len, V)
            p = torch.ones(())
            for i, t in enumerate(path):
                p = p * target_probs(logits[len(prompt) - 1 + i], params)[t]
            probs[path] = p * target_probs(logits[-1], params)  # (V,)
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
        seeded = replace(params, seed=seed)
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
MIN_P = SamplingParams(temperature=1.0, min_p=0.3)


# over gRPC one case: 2,000 generations through real workers, 16 at a time
@pytest.mark.parametrize(
    "transport, params, tree",
    [
        ("inprocess", SAMPLED, TreeSpec(depth=2, branching=3, budget=8)),
        ("inprocess", TRUNCATED, TreeSpec(depth=2, branching=2)),
        ("grpc", SAMPLED, TreeSpec(depth=2, branching=3, budget=8)),
        ("grpc", MIN_P, TreeSpec(depth=2, branching=3, budget=8)),
    ],
)
async def test_sampled_pairs_follow_the_target_distribution(transport, params, tree):
    expected = exact_distribution(tiny_hf_model(vocab=VOCAB, seed=4), params)
    counts = await sampled_counts(transport, params, tree)
    assert_follows(counts, expected)


async def test_bfloat16_sampled_pairs_follow_the_bfloat16_target_distribution():
    expected = engine_two_token_distribution(engines(torch.bfloat16)[0], SAMPLED)
    tree = TreeSpec(depth=2, branching=3, budget=8)
    counts = await sampled_counts("inprocess", SAMPLED, tree, torch.bfloat16)
    assert_follows(counts, expected)


# each token after the prompt's last two (1, 4) followed them once before, with a token
# after it: whatever the first token sampled, the next decode step's lookup drafts
LOOKUP_PROMPT = [t for x in range(VOCAB) for t in (1, 4, x, (x + 2) % VOCAB)] + [1, 4]
LOOKED_UP = 4  # tokens a generation: the first, then one call of 3 steps drafting 2 ahead


async def test_sampled_decode_steps_with_the_workers_lookups_follow_the_target_distribution():
    """Unseeded sampled generations over a real gRPC target whose decode steps verify its own
    lookups (a seeded request takes none): every pair of neighbouring tokens follows the
    target's distribution. The runs draw from unseeded generators, so each test's p-value
    bound is 1e-5 (the three of them fail together by chance about once in 30,000 runs)."""
    hf = tiny_hf_model(vocab=VOCAB, seed=4)
    expected = exact_distribution(hf, SAMPLED, LOOKUP_PROMPT, LOOKED_UP)
    config = EngineConfig(max_sessions=CONCURRENT, max_seq_len=64)
    target = Engine.from_hf(hf, None, config, "target")
    counts = torch.zeros((VOCAB,) * LOOKED_UP)
    drafted = 0
    async with pair("grpc", target, None, lookup_rows=64) as route:
        for first in range(0, RUNS, CONCURRENT):
            runs = (
                run(route, LOOKUP_PROMPT, LOOKED_UP, params=SAMPLED, steps=4, lookup=3)
                for _ in range(first, min(first + CONCURRENT, RUNS))
            )
            for gen in await asyncio.gather(*runs):
                counts[tuple(gen.token_ids)] += 1
                drafted += gen.stats.draft_tokens
    assert drafted >= 2 * RUNS  # every generation's first step looked 2 tokens up
    for i in range(LOOKED_UP - 1):
        others = tuple(d for d in range(LOOKED_UP) if d not in (i, i + 1))
        assert_follows(counts.sum(others), expected.sum(others), p_min=1e-5)


def assert_follows(counts: torch.Tensor, expected: torch.Tensor, p_min: float = 1e-3) -> None:
    """The sampled pairs' counts against the exact distribution: chi-square, full support."""
    cells = [(a, b) for a, b in itertools.product(range(VOCAB), repeat=2) if expected[a, b] > 0]
    assert counts.sum() == RUNS
    assert sum(counts[a, b] for a, b in cells) == RUNS  # nothing outside the support
    observed = [float(counts[a, b]) for a, b in cells]
    wanted = [float(expected[a, b]) * RUNS for a, b in cells]
    scale = sum(observed) / sum(wanted)
    result = chisquare(observed, [w * scale for w in wanted])
    assert result.pvalue > p_min, result
