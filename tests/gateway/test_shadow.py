"""Shadow drafts: a session with an n-gram draft that does not draft still learns what its
text would have accepted, from the tokens the target emits, and needs no probes."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
import torch
from openai import OpenAI

from gateway.adaptive import Acceptance, AdaptiveConfig, Rates, RatesByMatch, RoundShape
from gateway.shadow import Shadow
from tests.gateway.helpers import MODEL, live, sample, slow_target
from workers.protocol import TreeSpec
from workers.speculation.tree import TokenTree

CONFIG = AdaptiveConfig(knee_tokens=20.0, ewma=0.3, prior_rate=0.8, probe_every=1)
SPEC = TreeSpec(depth=4, branching=2, budget=8)
# 5 -> 6 -> 7 is the spine; 8 -> 9 the younger branch
TREE = TokenTree(torch.tensor([5, 8, 6, 9, 7]), torch.tensor([-1, -1, 0, 1, 2]))


def test_a_shadow_waits_for_the_tokens_that_decide_it():
    shadow = Shadow.of(2, TREE)
    assert shadow.shape == RoundShape(depth=3, spine=3, nodes=5)
    assert shadow.score([1, 2]) is None  # nothing emitted after it yet
    assert shadow.score([1, 2, 5]) is None  # on the spine, which goes on
    assert shadow.score([1, 2, 5, 6]) is None


@pytest.mark.parametrize(
    "emitted, accepted, spine_accepted",
    [
        ([4], 0, 0),  # the first token left the tree
        ([5, 4], 1, 1),
        ([5, 6, 7], 3, 3),  # the spine to its end: used up (a censored round)
        ([5, 6, 7, 1], 3, 3),
        ([8, 9], 2, 0),  # the younger branch to its end
        ([8, 1], 1, 0),
    ],
)
def test_a_shadow_accepts_what_a_verify_of_its_tree_would(emitted, accepted, spine_accepted):
    scored = Shadow.of(2, TREE).score([1, 2, *emitted])
    assert (scored.accepted, scored.spine_accepted) == (accepted, spine_accepted)
    assert scored.shape == RoundShape(3, 3, 5)


def test_an_empty_lookup_leaves_no_shadow():
    assert Shadow.of(4, TokenTree.empty()) is None


def ngram_session(history: list[int], rate: float, long_rate: float | None = None):
    """A session of a gateway whose draft is the n-gram one, its history already fed to
    the target; every session's estimates at `rate`, after a 3-token match at `long_rate`
    (default the same)."""
    from gateway.metrics import Metrics
    from gateway.speculation import LoopOptions, Speculation
    from workers.loop import Plan
    from workers.speculation.sampling import SamplingParams

    class Router:
        def session_id(self, key, index):
            return f"s{index}"

    plan = Plan(history, 64, SamplingParams(), SPEC, frozenset())

    def at(alpha: float) -> Rates:
        return Rates(Acceptance(alpha, 1 - alpha), Acceptance(alpha, 1 - alpha))

    recent = RatesByMatch(
        [at(rate), at(rate), at(rate), at(rate if long_rate is None else long_rate)]
    )
    speculation = Speculation(Router(), plan, Metrics(), None, 0, LoopOptions(CONFIG), recent)
    speculation.draft.worker = SimpleNamespace(info=SimpleNamespace(model_id="ngram"))
    speculation.target.held = len(speculation.history)
    return speculation


def test_a_session_that_does_not_draft_learns_from_its_shadows_and_never_probes():
    # "1 2 3 4" came before: the n-gram draft would copy "4 ..." after the last "3"
    speculation = ngram_session([1, 2, 3, 4, 9, 1, 2, 3], rate=0.02)
    for token in [4, 9, 1, 2]:  # the target goes on copying; alpha 0.02 never drafts
        assert speculation.shape(SPEC) is None  # probe_every 1 would probe every round
        assert speculation.shadow is not None and speculation.shadow.kind == 3
        speculation.history.append(token)
        speculation.target.held += 1
        speculation.observe_shadow(speculation.shadow)
    assert speculation.shadow is None  # decided: the copied run went to the tree's end
    own, every = speculation.rates[3], speculation.recent[3]
    assert own.measured == 1 and own.chain.rate > 0.5  # its shadow was accepted whole
    assert every.chain.rate > 0.5  # and new sessions start from it
    assert speculation.rates[1].chain.rate == pytest.approx(0.02)  # other kinds unchanged


def test_a_long_match_drafts_where_a_one_token_match_does_not():
    long = ngram_session([1, 2, 3, 4, 9, 1, 2, 3], rate=0.02, long_rate=0.9)
    assert long.shape(SPEC) is not None and long.kind == 3
    short = ngram_session([5, 7, 8, 9, 5], rate=0.02, long_rate=0.9)
    assert short.shape(SPEC) is None and short.kind == 1 and short.shadow is not None
    nothing = ngram_session([1, 2, 3], rate=0.9, long_rate=0.9)
    assert nothing.shape(SPEC) is None and nothing.kind == 0
    assert nothing.shadow is None  # no match, no suffix cache: nothing to draft or learn


def test_a_session_with_a_model_draft_still_probes():
    speculation = ngram_session([1, 2, 3, 4, 9, 1, 2, 3], rate=0.02)
    speculation.draft.worker = SimpleNamespace(info=SimpleNamespace(model_id="m"), feature_size=0)
    shaped = speculation.shape(SPEC)  # probe_every 1: every round off probes
    assert shaped is not None and shaped.budget == 1 and speculation.shadow is None


def test_shadows_are_counted_and_never_change_the_output(tiny_dir):
    """Every token fed costs 20 ms (a compute-bound target): once measured, drafting does
    not pay, the n-gram draft's trees are shadows, and the text is the one fixed trees give."""
    prompt = "one two three one two three one two three one"
    texts, shadows = [], []
    for adaptive in (False, True):
        dear = slow_target(tiny_dir, "t0", 0.0, token_delay=0.020)
        with live(tiny_dir, [dear], adaptive_tree=adaptive, tree_depth=6) as gateway:
            client = OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
            reply = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=48, temperature=0
            )
            texts.append(reply.choices[0].text)
            metrics = httpx.get(gateway.url + "/metrics").text
            shadows.append(sample(metrics, "specsplit_shadow_draft_tokens_total"))
    assert texts[0] == texts[1]
    assert shadows[0] == 0 and shadows[1] > 0
