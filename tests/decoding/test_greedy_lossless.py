"""Speculative greedy output equals target-only greedy output, token for token."""

import pytest
import torch

from tests.engine.tiny import tiny_engine, tiny_hf_model
from workers.decoder import SpecDecoder
from workers.draft.runner import ModelDrafter, NgramDrafter
from workers.engine.engine import Engine, EngineConfig
from workers.engine.sessions import SessionTable
from workers.protocol import TreeSpec, VerifyCall
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree
from workers.target.runner import TargetRunner

GREEDY = SamplingParams()


def target_only(seed: int, prompt: list[int], n: int) -> list[int]:
    engine = tiny_engine(seed=seed, slots=2)
    decoder = SpecDecoder(TargetRunner(engine, SessionTable(2)), None)
    return decoder.generate(prompt, n, GREEDY).token_ids


def hf_greedy(seed: int, prompt: list[int], n: int) -> list[int]:
    hf = tiny_hf_model(seed=seed)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n
        )
    return out[0, len(prompt) :].tolist()


def perturbed_draft(seed: int, noise: float, slots: int = 2) -> Engine:
    """A copy of the target with noisy weights: accepts some nodes, not all."""
    hf = tiny_hf_model(seed=seed)
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise)
    return Engine.from_hf(hf, None, EngineConfig(max_sessions=slots, max_seq_len=256), "draft")


PROMPTS = [[5, 17, 3, 88, 41, 5, 17], list(range(20, 32)), [7] * 9]


@pytest.mark.parametrize("seed", [0, 1])
def test_target_only_equals_transformers_generate(seed):
    for prompt in PROMPTS:
        assert target_only(seed, prompt, 24) == hf_greedy(seed, prompt, 24)


@pytest.mark.parametrize(
    "spec",
    [
        TreeSpec(depth=4, branching=1, budget=4),
        TreeSpec(depth=3, branching=2, budget=8),
        TreeSpec(depth=5, branching=3, budget=16),
        TreeSpec(depth=2, branching=4, budget=6),
    ],
)
@pytest.mark.parametrize("seed", [0, 2])
def test_model_draft_tree_is_lossless(spec, seed):
    draft = perturbed_draft(seed, noise=0.01)
    target = tiny_engine(seed=seed, slots=2)
    decoder = SpecDecoder(
        TargetRunner(target, SessionTable(2)), ModelDrafter(draft, SessionTable(2)), spec
    )
    for prompt in PROMPTS:
        gen = decoder.generate(prompt, 30, GREEDY)
        assert gen.token_ids == target_only(seed, prompt, 30)
        assert gen.stats.verify_steps < 30  # the draft helped at least once


def test_partial_acceptance_happens():
    """The perturbed draft is accepted sometimes but not always."""
    draft = perturbed_draft(0, noise=0.01)
    decoder = SpecDecoder(
        TargetRunner(tiny_engine(seed=0), SessionTable(2)),
        ModelDrafter(draft, SessionTable(2)),
        TreeSpec(depth=4, branching=2, budget=8),
    )
    stats = decoder.generate(PROMPTS[1], 40, GREEDY).stats
    assert 0.0 < stats.acceptance_rate < 1.0


@pytest.mark.parametrize("spec", [TreeSpec(depth=4, branching=1), TreeSpec(depth=6, budget=12)])
def test_ngram_draft_is_lossless(spec):
    target = tiny_engine(seed=1, slots=2)
    decoder = SpecDecoder(
        TargetRunner(target, SessionTable(2)), NgramDrafter(SessionTable(8)), spec
    )
    for prompt in PROMPTS:
        assert decoder.generate(prompt, 30, GREEDY).token_ids == target_only(1, prompt, 30)


def test_kv_cache_after_many_rounds_equals_fresh_prefill():
    target = tiny_engine(seed=0, slots=2)
    runner = TargetRunner(target, SessionTable(2))
    decoder = SpecDecoder(
        runner, ModelDrafter(perturbed_draft(0, 0.01), SessionTable(2)), TreeSpec(4, 2, 8)
    )
    prompt = PROMPTS[0]
    gen = decoder.generate(prompt, 40, GREEDY)
    assert gen.stats.verify_steps > 5
    # replay the same rounds without ending the session, then inspect the slot
    runner.end = lambda sid: True  # keep the session's cache to look at it
    gen = decoder.generate(prompt, 40, GREEDY)
    (session,) = runner.table.sessions.values()
    n = session.cached
    fresh = tiny_engine(seed=0, slots=1)
    fresh_runner = TargetRunner(fresh, SessionTable(1))
    fresh_runner.verify([VerifyCall("x", 0, session.committed[: n + 1], TokenTree.empty(), GREEDY)])
    slot = session.slot
    assert torch.allclose(target.cache.k[:, slot, :, :n], fresh.cache.k[:, 0, :, :n], atol=1e-4)
    assert torch.allclose(target.cache.v[:, slot, :, :n], fresh.cache.v[:, 0, :, :n], atol=1e-4)
