"""The n-gram drafter's shortest match (`--ngram-min-match`, vLLM's prompt_lookup_min)."""

from __future__ import annotations

import pytest
from openai import OpenAI
from pydantic import ValidationError

from gateway.settings import GatewaySettings
from tests.gateway.helpers import MODEL, live, load_engine
from tests.workers.helpers import draft_worker
from workers.draft.ngram import MIN_MATCH, NgramDrafter
from workers.engine.sessions import SessionTable
from workers.loop.inprocess import InProcessTarget
from workers.protocol import ProposeCall, TreeSpec
from workers.target.runner import TargetRunner

SPEC = TreeSpec(depth=3, branching=1, budget=3)
ONE = [5, 9, 7, 5]  # its last token occurred before; no longer suffix did
TWO = [5, 9, 7, 8, 5, 9]  # its last two tokens occurred before


def drafted(drafter: NgramDrafter, history: list[int]) -> list[int]:
    (tree,) = drafter.propose([ProposeCall("s", 0, history, SPEC)])
    return tree.tokens.tolist()


def test_by_default_it_drafts_after_one_token_matches():
    drafter = NgramDrafter(SessionTable(4))
    assert MIN_MATCH == 1
    assert drafted(drafter, ONE) == [9, 7, 5]
    assert drafted(drafter, TWO) == [7, 8, 5]


@pytest.mark.parametrize(("min_match", "one", "two"), [(2, [], [7, 8, 5]), (3, [], [])])
def test_a_longer_shortest_match_drafts_less(min_match, one, two):
    drafter = NgramDrafter(SessionTable(4), min_match=min_match)
    assert drafted(drafter, ONE) == one
    assert drafted(drafter, TWO) == two


@pytest.mark.parametrize("bad", [0, 4])  # suffixes of 1 to MAX_NGRAM (3) tokens are matched
def test_the_gateway_setting_is_bounded(bad):
    with pytest.raises(ValidationError):
        GatewaySettings(target_addresses="t:1", ngram_min_match=bad)


def test_the_gateways_draft_follows_the_setting_and_the_text_stays_the_targets(tiny_dir):
    """The same greedy text whatever the shortest match; one-token matches draft more."""
    prompt = [{"role": "user", "content": "one two three one two three one two three one two"}]
    stats, texts = {}, {}
    for min_match in (1, 3):
        target = InProcessTarget("t0", TargetRunner(load_engine(tiny_dir), SessionTable(4)))
        with live(tiny_dir, [target], adaptive_tree=False, ngram_min_match=min_match) as gateway:
            client = OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
            reply = client.chat.completions.create(
                model=MODEL,
                messages=prompt,
                max_tokens=32,
                temperature=0,
                extra_body={"speculation_stats": True},
            )
        stats[min_match] = reply.model_extra["speculation_stats"]["draft_tokens"]
        texts[min_match] = reply.choices[0].message.content
    assert texts[1] == texts[3]
    assert stats[1] > stats[3]


@pytest.mark.parametrize(("min_match", "one"), [(MIN_MATCH, [9, 7, 5]), (2, [])])
async def test_a_remote_ngram_draft_worker_takes_the_setting(min_match, one):
    """`specsplit worker draft --model ngram --ngram-min-match N`, over gRPC."""
    async with draft_worker(None, ngram_min_match=min_match) as (_, draft):
        tree = await draft.propose(ProposeCall("s", 0, ONE, SPEC))
        assert tree.tokens.tolist() == one
