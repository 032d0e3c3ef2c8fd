"""Losslessness on the embedded SmolLM2-135M-Instruct: 64 new tokens, several prompts.

The prompts' generations run at once through real gRPC workers, as the gateway runs them:
the workers batch the sessions' calls, so a round of all three costs about one forward
(the engine is batch-invariant: a row's logits do not depend on the rows beside it).
"""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.decoding.pairs import NGRAM, SERVED_BATCH_WAIT_MS, pair, run
from workers.draft.ngram import NgramDrafter
from workers.engine.engine import Engine, EngineConfig
from workers.engine.sessions import SessionTable
from workers.engine.text import encode_chat, stop_token_ids
from workers.loop import Generation
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
SLOTS = len(MESSAGES) + 1  # every prompt's session at once, and one to spare


@pytest.fixture(scope="module")
def prompts(embedded_tokenizer):
    return [encode_chat(embedded_tokenizer, [{"role": "user", "content": m}]) for m in MESSAGES]


@pytest.fixture(scope="module")
def target(embedded_hf, embedded_tokenizer):
    config = EngineConfig(max_sessions=SLOTS, max_seq_len=512)
    return Engine.from_hf(embedded_hf, embedded_tokenizer, config, "smollm2-135m-instruct")


async def generate_all(
    target: Engine,
    draft: Engine | str | None,
    prompts: list[list[int]],
    spec: TreeSpec = TreeSpec(),
    stop_ids: frozenset[int] = frozenset(),
) -> list[Generation]:
    """Each prompt's greedy generation of up to N tokens, all in flight at once."""
    async with pair("grpc", target, draft, batch_wait_ms=SERVED_BATCH_WAIT_MS) as route:
        return await asyncio.gather(
            *(run(route, p, N, spec, SamplingParams(), stop_ids) for p in prompts)
        )


@pytest.fixture(scope="module")
def target_only(target, prompts):
    """Target-only greedy up to N tokens or the end-of-sequence token."""
    stops = stop_token_ids(target.tokenizer)
    generations = asyncio.run(generate_all(target, None, prompts, stop_ids=stops))
    return [gen.token_ids for gen in generations]


def test_native_greedy_equals_transformers_generate(embedded_hf, prompts, target_only):
    assert sum(len(t) for t in target_only) > 2 * N  # long enough to mean something
    for prompt, ours in zip(prompts, target_only, strict=True):
        with torch.inference_mode():
            out = embedded_hf.generate(torch.tensor([prompt]), max_new_tokens=N, do_sample=False)
        assert ours == out[0, len(prompt) :].tolist()


async def test_decode_steps_own_lookups_equal_target_greedy(target, prompts, target_only):
    """No draft: every round past the first takes 4 decode steps, each verifying up to 3
    tokens the gRPC target looks up itself in the session's history (its cheap rows set to
    8 on this float32 engine), and the texts are the target's greedy ones."""
    stops = stop_token_ids(target.tokenizer)
    served = pair("grpc", target, None, batch_wait_ms=SERVED_BATCH_WAIT_MS, lookup_rows=8)
    async with served as route:
        generations = await asyncio.gather(
            *(run(route, p, N, stop_ids=stops, steps=4, lookup=3) for p in prompts)
        )
    assert [gen.token_ids for gen in generations] == target_only
    stats = [gen.stats for gen in generations]
    assert sum(s.draft_tokens for s in stats) > sum(s.accepted_tokens for s in stats) > 0
    for gen in generations:  # an accepted lookup saves a forward
        assert gen.stats.verify_steps + gen.stats.accepted_tokens == len(gen.token_ids)


@pytest.mark.parametrize("tree", [TreeSpec(depth=6, budget=16), TreeSpec(depth=6, branching=1)])
async def test_ngram_draft_equals_target_greedy(target, prompts, target_only, tree):
    generations = await generate_all(target, NGRAM, prompts, tree)
    assert [gen.token_ids for gen in generations] == target_only


async def test_model_draft_equals_target_greedy(
    embedded_model_dir, embedded_tokenizer, target, prompts, target_only
):
    """A genuinely different draft: the target's first 8 layers under its own head."""
    shallow = AutoModelForCausalLM.from_pretrained(
        embedded_model_dir, dtype=torch.float32, num_hidden_layers=8
    ).eval()
    draft = Engine.from_hf(shallow, embedded_tokenizer, EngineConfig(max_sessions=SLOTS), "shallow")
    generations = await generate_all(
        target,
        draft,
        prompts,
        TreeSpec(depth=4, branching=2, budget=8),
        stop_token_ids(embedded_tokenizer),
    )
    assert [gen.token_ids for gen in generations] == target_only
    assert sum(gen.stats.accepted_tokens for gen in generations) > 0


def test_stop_token_ends_generation(target, embedded_tokenizer, prompts):
    stops = stop_token_ids(embedded_tokenizer)
    decoder = LocalDecoder(
        TargetRunner(target, SessionTable(2)), NgramDrafter(SessionTable(4)), stop_ids=stops
    )
    gen = decoder.generate(prompts[2], 400, SamplingParams())
    assert gen.finish_reason == "stop"
    assert gen.token_ids[-1] in stops
    assert not set(gen.token_ids[:-1]) & stops
