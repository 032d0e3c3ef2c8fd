"""Losslessness on the embedded SmolLM2-135M-Instruct: 64 new tokens, several prompts."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from workers.draft.ngram import NgramDrafter
from workers.draft.runner import ModelDrafter
from workers.engine.engine import Engine, EngineConfig
from workers.engine.sessions import SessionTable
from workers.engine.text import encode_chat, stop_token_ids
from workers.loop.inprocess import LocalDecoder
from workers.protocol import TreeSpec
from workers.speculation.sampling import SamplingParams
from workers.target.runner import TargetRunner

pytestmark = pytest.mark.embedded

MESSAGES = [
    "Write a short story about a robot who learns to paint.",
    "Explain in detail how a bicycle works.",
    "Write a Python function that checks whether a number is prime, with comments.",
]
N = 64


@pytest.fixture(scope="module")
def prompts(embedded_tokenizer):
    return [encode_chat(embedded_tokenizer, [{"role": "user", "content": m}]) for m in MESSAGES]


@pytest.fixture(scope="module")
def target(embedded_hf, embedded_tokenizer):
    config = EngineConfig(max_sessions=2, max_seq_len=512)
    return Engine.from_hf(embedded_hf, embedded_tokenizer, config, "smollm2-135m-instruct")


@pytest.fixture(scope="module")
def target_only(target, prompts):
    """Target-only greedy up to N tokens or the end-of-sequence token."""
    stops = stop_token_ids(target.tokenizer)
    decoder = LocalDecoder(TargetRunner(target, SessionTable(2)), None, stop_ids=stops)
    return [decoder.generate(p, N, SamplingParams()).token_ids for p in prompts]


def test_native_greedy_equals_transformers_generate(embedded_hf, prompts, target_only):
    assert sum(len(t) for t in target_only) > 2 * N  # long enough to mean something
    for prompt, ours in zip(prompts, target_only, strict=True):
        with torch.inference_mode():
            out = embedded_hf.generate(torch.tensor([prompt]), max_new_tokens=N, do_sample=False)
        assert ours == out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("tree", [TreeSpec(depth=6, budget=16), TreeSpec(depth=6, branching=1)])
def test_ngram_draft_equals_target_greedy(target, prompts, target_only, tree):
    decoder = LocalDecoder(
        TargetRunner(target, SessionTable(2)), NgramDrafter(SessionTable(4)), tree
    )
    for prompt, expected in zip(prompts, target_only, strict=True):
        gen = decoder.generate(prompt, N, SamplingParams())
        assert gen.token_ids == expected


def test_model_draft_equals_target_greedy(
    embedded_model_dir, embedded_tokenizer, target, prompts, target_only
):
    """A genuinely different draft: the target's first 8 layers under its own head."""
    shallow = AutoModelForCausalLM.from_pretrained(
        embedded_model_dir, dtype=torch.float32, num_hidden_layers=8
    ).eval()
    draft = Engine.from_hf(shallow, embedded_tokenizer, EngineConfig(max_sessions=2), "shallow")
    decoder = LocalDecoder(
        TargetRunner(target, SessionTable(2)),
        ModelDrafter(draft, SessionTable(2)),
        TreeSpec(depth=4, branching=2, budget=8),
        stop_token_ids(embedded_tokenizer),
    )
    accepted = 0
    for prompt, expected in zip(prompts, target_only, strict=True):
        gen = decoder.generate(prompt, N, SamplingParams())
        assert gen.token_ids == expected
        accepted += gen.stats.accepted_tokens
    assert accepted > 0


def test_stop_token_ends_generation(target, embedded_tokenizer, prompts):
    stops = stop_token_ids(embedded_tokenizer)
    decoder = LocalDecoder(
        TargetRunner(target, SessionTable(2)), NgramDrafter(SessionTable(4)), stop_ids=stops
    )
    gen = decoder.generate(prompts[2], 400, SamplingParams())
    assert gen.finish_reason == "stop"
    assert gen.token_ids[-1] in stops
    assert not set(gen.token_ids[:-1]) & stops
