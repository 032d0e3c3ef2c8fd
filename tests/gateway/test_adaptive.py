"""Adaptive speculation: the policy reacts to acceptance, load and the target's measured cost,
and never changes output."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from openai import OpenAI

from gateway.adaptive import (
    Acceptance,
    AdaptiveConfig,
    Calibration,
    CostFit,
    Rates,
    RatesByMatch,
    Ratio,
    RoundCost,
    RoundShape,
    adapt,
    best_shape,
    can_pay,
    expected_tokens,
    weigh_shapes,
)
from gateway.epochs import Epochs
from tests.gateway.helpers import (
    MODEL,
    live,
    model_draft,
    recording_draft,
    slow_target,
    target,
)
from workers.protocol import TreeSpec

CONFIG = AdaptiveConfig(knee_tokens=20.0, ewma=0.3, prior_rate=0.8, probe_every=4)
SPEC = TreeSpec(depth=12, branching=2, budget=24)
CHAIN = TreeSpec(depth=16, branching=1, budget=16)
KNEE_20 = RoundCost(20.0, 1.0)


def rates(tree: float, chain: float | None = None) -> Rates:
    """Estimates of alpha = `tree` for trees and `chain` (default the same) for chains."""
    chain = tree if chain is None else chain
    return Rates(Acceptance(tree, 1.0 - tree), Acceptance(chain, 1.0 - chain))


def best_depth(rate: float, sessions: int, spec: TreeSpec, cost: RoundCost) -> int:
    return best_shape(rates(rate), sessions, spec, cost)[0]


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_acceptance_estimate_follows_the_rounds():
    acceptance = Acceptance.prior(CONFIG.prior_rate)
    assert acceptance.rate == pytest.approx(0.8)
    for _ in range(20):
        acceptance.observe(0, 6, CONFIG)  # rejected at once, every round
    low = acceptance.rate
    assert low < 0.05
    for _ in range(20):
        acceptance.observe(6, 6, CONFIG)  # the whole path accepted: no rejection counted
    assert acceptance.rate > 0.95
    before = acceptance.rate
    acceptance.observe(0, 0, CONFIG)  # nothing drafted: nothing learnt
    assert acceptance.rate == before


def test_depth_grows_with_acceptance_and_shrinks_with_load():
    depths = [best_depth(rate, 1, CHAIN, KNEE_20) for rate in (0.1, 0.5, 0.8, 0.95)]
    assert depths == sorted(depths) and depths[0] < depths[-1]
    by_load = [best_depth(0.8, s, CHAIN, KNEE_20) for s in (1, 4, 8, 16, 64)]
    assert by_load == sorted(by_load, reverse=True) and by_load[0] > by_load[-1]
    assert best_depth(0.3, 16, CHAIN, KNEE_20) == 0  # poor acceptance at high load: plain decoding
    assert best_depth(0.99, 1, TreeSpec(6, 1, 6), KNEE_20) == 6  # never past the configured depth
    gpu_like = RoundCost(2000.0, 1.0)
    assert best_depth(0.8, 16, CHAIN, gpu_like) > best_depth(0.8, 16, CHAIN, KNEE_20)


def test_a_tree_costs_its_nodes_and_a_draft_its_levels():
    # the same depth is dearer as a 2-wide tree than as a chain, and a slow draft shortens it
    wide = TreeSpec(depth=16, branching=2, budget=32)
    tree_depth, nodes = best_shape(rates(0.8, chain=0.0), 4, wide, KNEE_20)  # chains fail
    assert nodes > tree_depth and tree_depth < best_depth(0.8, 4, CHAIN, KNEE_20)
    slow_draft = RoundCost(20.0, 1.0, level_s=10.0)
    assert best_depth(0.8, 1, CHAIN, slow_draft) < best_depth(0.8, 1, CHAIN, KNEE_20)


def test_rounds_where_no_draft_can_pay_skip_weighing_shapes_and_choose_the_same():
    rng = random.Random(15)
    skipped = cut_short = 0
    for draw in range(6000):
        estimates = rates(rng.random() ** 2, rng.random() ** 2)
        overall = Ratio(1.0, rng.uniform(0.1, 1.5))
        # every other draw calibrates some depths on their own (the shortcut's bound is then
        # the largest factor): the same choice; the others keep one factor, where most
        # rounds without a draft must end at the shortcut
        own = draw % 2 == 1
        by_depth = {
            d: Ratio(1.0, rng.uniform(0.1, 1.5)) for d in range(1, 17) if own and rng.random() < 0.3
        }
        estimates.calibration = Calibration(overall, by_depth)
        cost = RoundCost(rng.uniform(0, 60), rng.uniform(0.01, 5), rng.choice([0, rng.random()]))
        if draw % 3 == 2:  # measured gaps and decode steps: a round without a draft is cheaper
            beside = rng.uniform(0, cost.fixed_s)
            cost = replace(cost, outside_s=rng.uniform(0, beside), beside_s=beside, steps=4)
        sessions, spec = rng.choice([1, 2, 8, 32, 64]), rng.choice([SPEC, CHAIN])
        chosen = best_shape(estimates, sessions, spec, cost)
        assert chosen == weigh_shapes(estimates, sessions, spec, cost)
        if not own:
            skipped += chosen == (0, 0)
            cut_short += not can_pay(estimates, sessions, cost)
    assert 300 < skipped < 2700  # both kinds of round were drawn
    assert cut_short > 0.75 * skipped  # most rounds without a draft never weigh the shapes


def test_decode_steps_make_a_round_without_a_draft_cheaper_and_trees_rarer():
    # a third of a round besides the forward: with four steps a token costs a quarter of it
    stepped = RoundCost(20.0, 1.0, outside_s=5.0, beside_s=10.0, steps=4)
    single = replace(stepped, steps=1)
    assert single.plain(8) == single.seconds(8, 0) == 33.0
    assert stepped.plain(8) == 33.0 - 7.5
    assert RoundCost(1.0, 0.0, beside_s=30.0, steps=4).plain(1) == 0.25  # never below a round / k
    modest = rates(0.35)  # pays a round of a token at a time, not one of four steps
    assert best_shape(modest, 8, SPEC, single) != (0, 0)
    assert best_shape(modest, 8, SPEC, stepped) == (0, 0)
    assert not can_pay(modest, 8, stepped)
    assert best_shape(rates(0.8), 8, SPEC, stepped) != (0, 0)  # a good draft still pays


def test_the_cost_fit_keeps_the_rounds_gaps_weighted_like_its_rounds():
    fit = CostFit()
    for n in [1, 17, 5]:
        fit.observe(n, 0.030 + 0.001 * n, CONFIG)
    assert (fit.line(CONFIG).outside_s, fit.line(CONFIG).beside_s) == (0.0, 0.0)  # none yet
    for _ in range(200):
        fit.observe_gaps(0.002, 0.004, CONFIG)
    line = fit.line(CONFIG)
    assert (line.outside_s, line.beside_s) == (pytest.approx(0.002), pytest.approx(0.004))
    for _ in range(200):  # a batch of four calls a forward weighs as one round
        for _ in range(4):
            fit.observe_gaps(0.006, 0.010, CONFIG, share=0.25)
    line = fit.line(CONFIG)
    assert line.outside_s == pytest.approx(0.006, rel=1e-3)
    assert line.beside_s == pytest.approx(0.010, rel=1e-3)
    assert line.seconds(1, 0) == pytest.approx(0.031 + 0.006, rel=0.05)


def test_adapt_keeps_the_shape_within_the_configured_tree():
    trees_pay = rates(0.95, chain=0.3)  # the other branches catch most of what the spine misses
    full = adapt(SPEC, trees_pay, 1, KNEE_20, CONFIG)
    assert full.depth <= SPEC.depth and full.budget <= SPEC.budget
    assert full.budget == max(full.depth, round(full.depth * SPEC.budget / SPEC.depth))
    loaded = adapt(SPEC, trees_pay, 16, KNEE_20, CONFIG)
    assert loaded.depth < full.depth and loaded.budget < full.budget
    assert loaded.branching == SPEC.branching
    assert adapt(TreeSpec(depth=0), trees_pay, 1, KNEE_20, CONFIG) is None


def test_a_chain_replaces_the_tree_when_the_spine_accepts_as_much():
    # the other branches add nothing: the spine alone, as a chain, costs fewer tokens
    spines_do = rates(0.8)
    chain = adapt(SPEC, spines_do, 4, KNEE_20, CONFIG)
    assert chain.branching == 1 and chain.budget == chain.depth > 0
    # where tokens are dear every tree of the configured shape costs more than it brings, but
    # a chain of the spine's acceptance still pays
    dear, wide = RoundCost(20.0, 3.0), TreeSpec(6, 2, 16)
    depth, nodes = best_shape(rates(0.6), 8, wide, dear)
    assert nodes == depth > 0
    assert best_shape(rates(0.6, chain=0.0), 8, wide, dear) == (0, 0)


def test_promises_that_did_not_come_true_shrink_the_trees_of_every_session():
    recent = rates(0.6)
    session = recent.fresh()
    assert session.calibration is recent.calibration  # measured over every session's rounds
    before = best_shape(session, 4, SPEC, KNEE_20)
    chain = RoundShape(depth=2, spine=2, nodes=2)
    promised = session.promise(chain)
    assert promised == pytest.approx(0.6 + 0.36)
    assert before[0] > 0
    for _ in range(200):  # the rounds accept nothing of what their estimates promised
        session.calibration.observe(2, promised, 0, CONFIG)
    assert recent.fresh().calibration.factor(2) == pytest.approx(0.0, abs=0.05)
    assert recent.fresh().calibration.factor(5) == pytest.approx(0.0, abs=0.05)  # every depth's
    assert best_shape(session, 4, SPEC, KNEE_20) == (0, 0)  # in no session, whatever its rates
    for _ in range(200):  # the promises come true again
        session.calibration.observe(2, promised, 1, CONFIG)
    assert recent.fresh().calibration.factor(2) == pytest.approx(1 / promised, rel=0.05)
    assert best_shape(session, 4, SPEC, KNEE_20) == before


def test_deep_chains_that_fall_short_of_their_promise_get_shallower_alone():
    # acceptance is not geometric: short chains keep their promise, deep ones accept far less
    estimates = rates(0.7)
    cost = RoundCost(20.0, 1.0)
    deep = best_shape(estimates, 1, CHAIN, cost)[0]
    assert deep >= 6
    shallow = RoundShape(depth=2, spine=2, nodes=2)
    for _ in range(300):
        estimates.calibration.observe(2, estimates.promise(shallow), 1, CONFIG)  # 1 of 1.19
        for depth in (4, 6, 8):  # deep chains accept one token of several
            chain = RoundShape(depth=depth, spine=depth, nodes=depth)
            estimates.calibration.observe(depth, estimates.promise(chain), 1, CONFIG)
    # each near its own ratio (depth 2's pulled a little towards every depth's, mostly deep)
    assert 0.7 < estimates.calibration.factor(2) < 1 / 1.19
    assert estimates.calibration.factor(6) < 0.5
    depth = best_shape(estimates, 1, CHAIN, cost)[0]
    assert 0 < depth < 4  # chains as deep as their promise still holds
    assert estimates.calibration.most() == estimates.calibration.factor(2)
    # the text turns copyable: the chains drafted (as deep as the policy now allows) accept
    # all they draft, and the deep depths, drafted no more, relax back towards them
    for _ in range(3000):
        depth = best_shape(estimates, 1, CHAIN, cost)[0]
        chain = RoundShape(depth=depth, spine=depth, nodes=depth)
        estimates.calibration.observe(depth, estimates.promise(chain), depth, CONFIG)
    assert best_shape(estimates, 1, CHAIN, cost)[0] >= deep


def test_rates_learn_trees_from_trees_and_chains_from_every_spine():
    learnt = Rates.prior(CONFIG)
    for _ in range(20):  # trees that are accepted through their second branches
        learnt.observe(RoundShape(depth=3, spine=3, nodes=8), 3, 0, CONFIG)
    assert learnt.tree.rate > 0.95 and learnt.chain.rate < 0.05
    for _ in range(20):  # chains, fully accepted: the tree's estimate keeps what it had
        learnt.observe(RoundShape(depth=3, spine=3, nodes=3), 3, 3, CONFIG)
    assert learnt.tree.rate > 0.95 and learnt.chain.rate > 0.95


def test_the_cost_fit_learns_a_line_and_keeps_the_prior_split_without_spread():
    fit = CostFit()
    assert fit.line(CONFIG) == RoundCost.prior(CONFIG)
    for n in [1, 17, 5, 130, 9, 1, 33] * 20:  # rounds of many sizes: the data decides
        fit.observe(n, 0.030 + 0.001 * n, CONFIG)
    line = fit.line(CONFIG)
    assert line.fixed_s == pytest.approx(0.030, rel=0.05)
    assert line.token_s == pytest.approx(0.001, rel=0.05)
    same = CostFit()
    for _ in range(50):  # every round feeds 17 tokens: the slope is not observable
        same.observe(17, 0.037, CONFIG)
    line = same.line(CONFIG)
    assert line.seconds(17, 0) == pytest.approx(0.037, rel=0.01)
    assert line.fixed_s / line.token_s == pytest.approx(CONFIG.knee_tokens, rel=0.01)


def test_the_line_is_fitted_once_between_rounds_and_again_after_each():
    fit = CostFit()
    for n in [1, 17, 5, 130]:
        fit.observe(n, 0.030 + 0.001 * n, CONFIG)
    line = fit.line(CONFIG)
    assert fit.line(CONFIG) is line  # the batch's other sessions ask again: the same line
    other = replace(CONFIG, knee_tokens=4.0)
    assert fit.line(other) == fit.fit(other) != line
    fit.observe(9, 0.5, CONFIG)
    assert fit.line(CONFIG) == fit.fit(CONFIG) != line


def test_a_forward_counts_once_whatever_the_calls_it_served():
    sizes = [(8, 0.030), (9, 0.031), (40, 0.060), (8, 0.029), (12, 0.035)] * 10
    once, per_call = CostFit(), CostFit()
    for n, seconds in sizes:
        once.observe(n, seconds, CONFIG)
        calls = n // 4  # the batch's sessions each report the same forward
        for _ in range(calls):
            per_call.observe(n, seconds, CONFIG, share=1 / calls)
    assert per_call.line(CONFIG).fixed_s == pytest.approx(once.line(CONFIG).fixed_s, rel=1e-3)
    assert per_call.line(CONFIG).token_s == pytest.approx(once.line(CONFIG).token_s, rel=1e-3)


def test_the_cost_fit_follows_a_target_that_changes():
    fit = CostFit()
    for n in [1, 17, 3, 9] * 30:  # fixed cost dominates: knee far above the prior's 20
        fit.observe(n, 0.100 + 0.0002 * n, CONFIG)
    cheap_tokens = fit.line(CONFIG)
    assert cheap_tokens.fixed_s / cheap_tokens.token_s > 100
    for n in [1, 17, 3, 9] * 30:  # now every token costs: the knee falls below 1
        fit.observe(n, 0.002 + 0.005 * n, CONFIG)
    dear_tokens = fit.line(CONFIG)
    assert dear_tokens.fixed_s / dear_tokens.token_s < 1
    assert best_depth(0.6, 1, SPEC, dear_tokens) < best_depth(0.6, 1, SPEC, cheap_tokens)


@pytest.mark.parametrize("sessions", [1, 16])
def test_speculation_backs_off_and_probes_once_a_batch_of_probe_every(sessions):
    poor = rates(0.02)  # below the 1 / 21 that one more token costs a round at S = 1
    period = CONFIG.probe_every * sessions  # a batch of S sessions carries one probe in 4
    specs = [adapt(SPEC, poor, sessions, KNEE_20, CONFIG) for _ in range(2 * period)]
    probes = [i for i, s in enumerate(specs) if s is not None]
    assert probes == [period - 1, 2 * period - 1]
    assert all(specs[i].depth == 1 and specs[i].budget == 1 for i in probes)  # one node


@pytest.mark.parametrize("sessions", [1, 16])
def test_sessions_count_their_rounds_towards_a_probe_together(sessions):
    """Rounds without a draft count towards a kind's probe over every session (`probes`):
    two sessions taking turns probe once every probe_every x S rounds between them, where
    each counting its own would take twice as long."""
    own = [rates(0.02), rates(0.02)]
    every = rates(0.02)
    period = CONFIG.probe_every * sessions
    specs = [adapt(SPEC, own[i % 2], sessions, KNEE_20, CONFIG, every) for i in range(2 * period)]
    assert [i for i, s in enumerate(specs) if s is not None] == [period - 1, 2 * period - 1]
    assert own[0].rounds_off == own[1].rounds_off == 0  # their own counts are not used


def test_a_session_counts_its_rounds_in_every_sessions_rates():
    prompt = (5, 6, 7, 8) * 2  # every round matches 3 tokens
    speculation = session(rates(0.02), prompt, ngram=True)
    assert speculation.shape(SPEC) is None  # no draft pays at alpha 0.02
    kind = speculation.kind
    assert speculation.recent[kind].rounds_off == 1 and speculation.rates.rounds_off == 0


@pytest.fixture(scope="module", params=["model", "ngram"])
def greedy_texts(request, tiny_dir, tiny_draft_dir):
    """Greedy replies with adaptive trees off (the reference) and on, with a draft model or
    the gateway's n-gram draft (its rounds estimated by the suffix each lookup matched)."""
    prompts = ["one two three one two three one", "hello world , the cat sat on the mat"]
    out = {}
    for adaptive in (False, True):
        backends = [target(tiny_dir)]
        if request.param == "model":
            backends.append(model_draft(tiny_draft_dir))
        with live(tiny_dir, backends, adaptive_tree=adaptive, tree_depth=6) as gateway:
            client = OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
            texts, stats = [], []
            for prompt in prompts:
                reply = client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=40,
                    temperature=0,
                    extra_body={"speculation_stats": True},
                )
                texts.append(reply.choices[0].message.content)
                stats.append(reply.model_extra["speculation_stats"])
            out[adaptive] = texts, stats
    return out


def test_adaptive_trees_do_not_change_the_output(greedy_texts):
    fixed, _ = greedy_texts[False]
    adaptive, stats = greedy_texts[True]
    assert adaptive == fixed
    assert sum(s["accepted_tokens"] for s in stats) > 0


def session(
    recent: Rates, prompt: tuple[int, ...] = (1, 2, 3), ngram: bool = False, steps: int = 1
):
    """A session's Speculation that starts from `recent` (for kind 0: no n-gram draft; with
    `ngram`, for every kind of n-gram round) with `prompt` as its history, no target bound,
    `steps` decode steps and, with `ngram`, an n-gram draft."""
    from types import SimpleNamespace

    from gateway.metrics import Metrics
    from gateway.speculation import LoopOptions, Speculation
    from workers.loop import Plan
    from workers.speculation.sampling import SamplingParams

    class Router:
        drafts = "the deployment's drafts"

        def session_id(self, key, index):
            return f"s{index}"

    plan = Plan(list(prompt), 8, SamplingParams(), SPEC, frozenset())
    kinds = RatesByMatch.prior(CONFIG).kinds
    by_match = RatesByMatch([recent.fresh() for _ in kinds] if ngram else [recent, *kinds[1:]])
    options = LoopOptions(CONFIG, decode_steps=steps)
    speculation = Speculation(Router(), plan, Metrics(), None, 0, options, by_match)
    if ngram:
        info = SimpleNamespace(model_id="ngram")
        speculation.draft.worker = SimpleNamespace(info=info, feature_size=0)
    speculation.target.held = len(plan.prompt) if ngram else 0
    return speculation


def test_a_new_session_starts_from_the_recent_acceptance():
    recent = rates(0.1, chain=0.2)
    recent.rounds_off = 3
    own = session(recent).rates
    assert own.tree.rate == pytest.approx(0.1) and own.chain.rate == pytest.approx(0.2)
    assert own.tree is not recent.tree and own.chain is not recent.chain and own.rounds_off == 0


def test_a_session_drafts_nothing_while_it_feeds_its_prompt():
    speculation = session(rates(0.9))
    assert speculation.shape(SPEC) is None  # the first round feeds the prompt
    speculation.target.held = len(speculation.history)
    assert speculation.shape(SPEC) is not None


def test_a_tree_the_target_cut_whole_keeps_the_session_from_drafting_for_a_while():
    speculation = session(rates(0.9))
    speculation.target.held = len(speculation.history)
    speculation.cut_by_target(3, 1)  # its last node would have opened a block of rows
    assert speculation.quiet == 0 and speculation.shape(SPEC) is not None
    speculation.cut_by_target(3, 3)  # every node would have
    assert speculation.quiet == CONFIG.probe_every  # rounds (times the target's sessions)
    assert speculation.shape(SPEC) is None
    speculation.quiet = 0
    assert speculation.shape(SPEC) is not None


def test_a_session_follows_every_sessions_estimate_until_it_has_drafted():
    recent = rates(0.02)
    speculation = session(recent)
    speculation.target.held = len(speculation.history)
    assert speculation.shape(SPEC) is None  # alpha 0.02 does not pay
    recent.observe(RoundShape(12, 12, 12), 12, 12, CONFIG)  # other sessions' rounds went well
    recent.observe(RoundShape(12, 12, 12), 12, 12, CONFIG)
    spec = speculation.shape(SPEC)
    assert spec is not None and speculation.rates.chain.rate == recent.chain.rate
    speculation.rates.observe(RoundShape(1, 1, 1), 0, 0, CONFIG)  # its own round
    own = speculation.rates.chain.rate
    recent.observe(RoundShape(12, 12, 12), 12, 12, CONFIG)
    speculation.shape(SPEC)
    assert speculation.rates.chain.rate == own != recent.chain.rate


def drafted_per_round(tiny_dir, tiny_draft_dir, delay: float, token_delay: float):
    """Tree nodes per verify round of one greedy reply through a target with that delay, the
    shapes the gateway asked the draft for, and the reply's text."""
    slow = slow_target(tiny_dir, "t0", delay, token_delay=token_delay)
    draft = recording_draft(tiny_draft_dir)
    with live(tiny_dir, [slow, draft], tree_depth=6) as gateway:
        client = OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
        reply = client.completions.create(
            model=MODEL,
            prompt="one two three one two three one two three one",
            max_tokens=48,
            temperature=0,
            extra_body={"speculation_stats": True},
        )
    stats = reply.model_extra["speculation_stats"]
    return stats["draft_tokens"] / stats["verify_steps"], draft.specs, reply.choices[0].text


def test_the_measured_cost_shrinks_trees_on_a_slow_target_and_grows_them_on_a_fast_one(
    tiny_dir, tiny_draft_dir
):
    # every token fed costs 20 ms (a compute-bound target): once measured, a tree does not
    # pay; only the first rounds (before the fit has seen rounds of two sizes) and probes draft
    dear, _, dear_text = drafted_per_round(tiny_dir, tiny_draft_dir, 0.0, 0.020)
    # 500 ms per round whatever it feeds (a slow network, a GPU): the full depth pays, unless
    # the draft's own seconds per level (5 ms here under a full test run) came near 40 ms.
    # Whether a round drafts it as the 16-node tree or as its 6-node spine rests on how much
    # more the side branches accept than a chain: for these tiny random models about 1% of a
    # round, less than the per-token cost the fit reads off a loaded machine's noise, so
    # either may come (the breadth choice has its own tests above)
    _, cheap_specs, cheap_text = drafted_per_round(tiny_dir, tiny_draft_dir, 0.500, 0.0)
    assert dear_text == cheap_text
    assert dear < 2.0
    # the first six draft calls come before 36 of the 48 tokens are out: none is cut short
    assert [spec.depth for spec in cheap_specs[:6]] == [6] * 6


def test_each_match_length_starts_from_its_share_of_the_prior():
    by_match = RatesByMatch.prior(CONFIG)
    assert [r.chain.rate for r in by_match.kinds] == pytest.approx([0.8, 0.8 / 3, 1.6 / 3, 0.8])
    fresh = by_match.fresh()
    assert fresh[2].calibration is by_match[2].calibration  # kept over every session's rounds
    assert fresh[2].calibration is not fresh[3].calibration


def test_an_ngram_round_is_weighed_by_the_suffix_its_lookup_matched():
    """After a 3-token match an n-gram session drafts where the rounds after 3-token matches
    went well, and not after a 1-token match where those went badly; with no match, the
    lookup has nothing to copy and the round drafts nothing."""
    three = session(rates(0.9), (5, 6, 7, 8, 5, 6, 7), ngram=True)
    one = session(rates(0.9), (5, 6, 7, 8, 9, 5), ngram=True)
    none = session(rates(0.9), (5, 6, 7, 8, 9), ngram=True)
    for _ in range(12):  # every session's rounds after 1-token matches: rejected at once
        one.recent[1].observe(RoundShape(6, 6, 12), 0, 0, CONFIG)
    assert three.shape(SPEC) is not None and three.kind == 3
    assert one.shape(SPEC) is None and one.kind == 1
    assert none.shape(SPEC) is None
    three.rates.observe(RoundShape(1, 1, 1), 0, 0, CONFIG)  # its own kind-3 round
    assert three.by_match[1].measured == 0 and three.by_match[3].measured == 1


def test_a_tenants_cached_outputs_count_as_a_full_match():
    from workers.draft.suffix import SuffixCache, SuffixCacheConfig

    speculation = session(rates(0.9), (5, 6, 7, 8, 9), ngram=True)
    assert speculation.match_kind() is None
    speculation.suffixes = SuffixCache(SuffixCacheConfig(1024, 4))
    speculation.suffixes.add(speculation.state.plan.tenant, [1], [7, 8, 9, 4, 2])
    assert speculation.match_kind() == 3


@pytest.mark.parametrize("dear", [True, False], ids=["compute-bound", "fixed-cost"])
def test_a_session_takes_steps_at_once_only_where_no_draft_would_pay(dear):
    """With decode steps, a round without a draft decodes a token at a time only while some
    kind of draft would beat rounds of steps (and one was accepted lately): on a target
    whose every token fed costs as much as a round's fixed part, none would, and the
    session steps at once after an accepted draft; on one whose round is mostly fixed cost
    it keeps a lookup every token."""
    from types import SimpleNamespace

    speculation = session(rates(0.8), (5, 6, 7, 8, 5, 6, 7), ngram=True, steps=4)
    fit = CostFit()
    for n in [8, 24, 16, 40] * 10:
        fit.observe(n, 0.010 * n if dear else 0.100 + 0.0001 * n, CONFIG)
        fit.observe_gaps(0.002, 0.004, CONFIG)
    speculation.target.worker = SimpleNamespace(
        cost=fit, load=8, max_tree_nodes=64, epochs=Epochs()
    )
    speculation.unaccepted = 0  # a draft was just accepted
    assert speculation.plain_steps() == (4 if dear else 1)
    speculation.unaccepted = 8  # none for twice the steps' tokens: steps either way
    assert speculation.plain_steps() == 4


def test_a_token_a_round_goes_on_only_while_it_brings_what_steps_would():
    """After an accepted draft, a session whose drafts may pay keeps a token a round (a
    lookup every token) while those rounds bring at least the tokens rounds of steps would
    have in their time (`Pace`): rounds that find no draft bring one token each for more
    than a stepped token's time, and the session, and every new one, steps; rounds whose
    drafts bring several tokens bring the token a round back. Where steps save nothing
    (no gaps learnt: in-process workers), those rounds teach nothing."""
    from types import SimpleNamespace

    from workers.loop.state import Round

    speculation = session(rates(0.8), (5, 6, 7, 8, 5, 6, 7), ngram=True, steps=4)
    fit = CostFit()
    for n in [8, 24, 16, 40] * 10:  # mostly fixed cost: drafts may pay
        fit.observe(n, 0.100 + 0.0001 * n, CONFIG)
        fit.observe_gaps(0.002, 0.040, CONFIG)  # steps save 30 ms of a ~100 ms token
    speculation.target.worker = SimpleNamespace(
        cost=fit, load=8, max_tree_nodes=64, epochs=Epochs()
    )
    speculation.cycle_s, speculation.unaccepted = 0.1, 0  # past its first round; accepted
    assert speculation.plain_steps() == 1
    nothing = Round([9], None, None)
    for _ in range(3):
        speculation.observe_pace(0, 0, nothing)
    assert speculation.plain_steps() == 4
    assert speculation.recent.pace.par > speculation.recent.pace.tokens
    assert speculation.recent.fresh().pace == speculation.recent.pace  # where new ones start
    copied = Round([5, 6, 7, 8], None, None, drafted=3, accepted=3)
    for _ in range(3):
        speculation.observe_pace(3, 3, copied)
    assert speculation.plain_steps() == 1

    free = CostFit()
    for n in [8, 24, 16, 40] * 10:
        free.observe(n, 0.100 + 0.0001 * n, CONFIG)
    speculation.target.worker = SimpleNamespace(
        cost=free, load=8, max_tree_nodes=64, epochs=Epochs()
    )
    before = replace(speculation.by_match.pace)
    speculation.observe_pace(0, 0, nothing)
    assert speculation.by_match.pace == before
