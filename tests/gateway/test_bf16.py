"""bfloat16 end to end: speculative greedy through the gateway's loop against the same
bfloat16 engine's target-only greedy (lossless means: the same engine, target only).

Known to differ (xfail, strict): the CPU scaled_dot_product_attention rounds a
query's output differently with the number of cache entries it reads (the
group's key width L, masked entries included): 1 float32 ulp, 1 bfloat16 ulp
(4e-3). A prompt prefilled in one forward and the same prompt fed one token
at a time leave slightly different keys and values, and in bfloat16 a
near-tie between the two most likely tokens can flip. The fix belongs to the
attention path (read a width that does not depend on the batch, or a
batch-invariant attention kernel); when it lands this test passes and the
xfail must go.
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


@pytest.mark.xfail(
    strict=True, reason="bfloat16 attention rounding depends on the key width read (see above)"
)
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


def test_bf16_serves_through_the_gateway(tiny_dir, tiny_draft_dir, target_only):
    # the bfloat16 engine serves speculative requests end to end, and agrees with its
    # target-only greedy up to the first near-tie
    backends = [target(tiny_dir, dtype="bfloat16"), model_draft(tiny_draft_dir)]
    with live(tiny_dir, backends, tree_depth=6) as gateway:
        texts = greedy(gateway)
    assert all(texts)
    assert [t.split()[:8] for t in texts] == [t.split()[:8] for t in target_only]
