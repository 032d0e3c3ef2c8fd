"""Sampling through the whole pipeline (engines, sampled draft tree, verification)
gives exactly the target's distribution: a chi-square test on a tiny vocabulary."""

import itertools

import pytest
import torch
from scipy.stats import chisquare

from tests.engine.tiny import tiny_hf_model
from workers.decoder import SpecDecoder
from workers.draft.runner import ModelDrafter
from workers.engine.engine import Engine, EngineConfig
from workers.engine.sessions import SessionTable
from workers.protocol import TreeSpec
from workers.speculation.sampling import SamplingParams, target_probs
from workers.target.runner import TargetRunner

VOCAB = 6
PROMPT = [1, 4, 2]
RUNS = 2000


def exact_two_token_distribution(hf, params: SamplingParams) -> torch.Tensor:
    """P(t1, t2 | prompt) under the target, with the request's sampling transforms."""
    probs = torch.zeros(VOCAB, VOCAB)
    with torch.no_grad():
        first = target_probs(hf(torch.tensor([PROMPT])).logits[0, -1], params)  # (V,)
        for t1 in range(VOCAB):
            logits = hf(torch.tensor([PROMPT + [t1]])).logits[0, -1]
            probs[t1] = first[t1] * target_probs(logits, params)  # (V,)
    return probs


def sampled_counts(params: SamplingParams, tree: TreeSpec) -> torch.Tensor:
    config = EngineConfig(max_sessions=2, max_seq_len=64)
    target = Engine.from_hf(tiny_hf_model(vocab=VOCAB, seed=4), None, config, "target")
    draft = Engine.from_hf(perturbed_draft_small(), None, config, "draft")
    decoder = SpecDecoder(
        TargetRunner(target, SessionTable(2)), ModelDrafter(draft, SessionTable(2)), tree
    )
    counts = torch.zeros(VOCAB, VOCAB)
    for run in range(RUNS):
        seeded = SamplingParams(params.temperature, params.top_p, params.top_k, seed=run)
        out = decoder.generate(PROMPT, 3, seeded).token_ids
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


@pytest.mark.parametrize(
    "params, tree",
    [
        (SamplingParams(temperature=1.0), TreeSpec(depth=2, branching=3, budget=8)),
        (SamplingParams(temperature=0.7, top_k=4, top_p=0.9), TreeSpec(depth=2, branching=2)),
    ],
)
def test_sampled_pairs_follow_the_target_distribution(params, tree):
    expected = exact_two_token_distribution(tiny_hf_model(vocab=VOCAB, seed=4), params)
    counts = sampled_counts(params, tree)
    cells = [(a, b) for a, b in itertools.product(range(VOCAB), repeat=2) if expected[a, b] > 0]
    assert counts.sum() == RUNS
    assert sum(counts[a, b] for a, b in cells) == RUNS  # nothing outside the support
    observed = [float(counts[a, b]) for a, b in cells]
    wanted = [float(expected[a, b]) * RUNS for a, b in cells]
    scale = sum(observed) / sum(wanted)
    result = chisquare(observed, [w * scale for w in wanted])
    assert result.pvalue > 1e-3, result
