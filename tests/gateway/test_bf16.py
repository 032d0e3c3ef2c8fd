"""bfloat16 end to end: speculative greedy through the gateway's loop against the same
bfloat16 engine's target-only greedy (lossless means: the same engine, target only).

This holds because the engine's forward is batch-invariant: a token's logits are
bit-identical whether it is prefilled, decoded alone, verified as a tree node or
batched with other sessions (workers/engine/attention.py,
tests/engine/test_batch_invariance.py). Without that, bfloat16 keys and values
one ulp apart flip near-ties between the two most likely tokens.
"""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.gateway.helpers import MODEL, live, model_draft, target

PROMPTS = ["one two three one two three one", "hello world , the cat sat on the mat"]


def greedy(gateway) -> list[str]:
    client = OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    return [
        client.completions.create(model=MODEL, prompt=p, max_tokens=40, temperature=0)
        .choices[0]
        .text
        for p in PROMPTS
    ]


@pytest.fixture(scope="module")
def target_only(tiny_dir):
    with live(tiny_dir, [target(tiny_dir, dtype="bfloat16")], local_draft="none") as gateway:
        return greedy(gateway)


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_bf16_speculative_greedy_equals_bf16_target_only(
    tiny_dir, tiny_draft_dir, target_only, draft
):
    backends = [target(tiny_dir, dtype="bfloat16")]
    if draft == "model":
        backends.append(model_draft(tiny_draft_dir))
    with live(tiny_dir, backends, adaptive_tree=False, tree_depth=6) as gateway:
        assert greedy(gateway) == target_only
    assert all(target_only)


def test_bf16_adaptive_tree_equals_bf16_target_only(tiny_dir, tiny_draft_dir, target_only):
    # the adaptive tree (shapes chosen per round) is as lossless as a fixed one
    backends = [target(tiny_dir, dtype="bfloat16"), model_draft(tiny_draft_dir)]
    with live(tiny_dir, backends, tree_depth=6) as gateway:
        assert greedy(gateway) == target_only
