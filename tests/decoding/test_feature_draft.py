"""A feature (EAGLE-style) draft through the one loop, in-process and over real gRPC workers:
greedy output is the target's, sampled output follows the target's distribution, the
target's hidden states cross the wire bit for bit, and a draft that lost its session
recovers without changing a token."""

import asyncio
import itertools
import uuid
from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare

from proto.specsplit.v1 import specsplit_pb2 as pb
from tests.decoding.pairs import TRANSPORTS, drafter, pair, run
from tests.decoding.test_greedy_lossless import PROMPTS, target_only
from tests.decoding.test_sampling_lossless import (
    PROMPT,
    RUNS,
    SAMPLED,
    VOCAB,
    exact_distribution,
)
from tests.engine.tiny import tiny_engine, tiny_hf_model
from tests.workers.helpers import draft_worker, target_worker
from workers.draft.features import FeatureDrafter
from workers.engine.eagle import EagleHead, draft_kind, init_eagle_head, save_eagle_head
from workers.engine.engine import Engine, EngineConfig
from workers.engine.sessions import SessionTable
from workers.loop import Loop, LoopState, Pair, Plan
from workers.loop.inprocess import InProcessDraft, InProcessTarget, LocalDecoder
from workers.protocol import (
    FEATURE_DTYPE,
    UNFINISHED,
    Features,
    IncompatibleWorkers,
    ProposeCall,
    TreeSpec,
    VerifyCall,
    VerifyOutcome,
    WorkerInfo,
    check_pair,
)
from workers.rpc import convert
from workers.speculation.acceptance import AcceptanceRule
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree
from workers.target.runner import TargetRunner

GREEDY = SamplingParams()
SPEC = TreeSpec(depth=4, branching=2, budget=8)


def eagle_engine(seed: int, vocab: int = 96, slots: int = 2, max_seq_len: int = 256) -> Engine:
    """A random EAGLE head over the tiny target of `seed`: lossless whatever it predicts."""
    head, fuse = init_eagle_head(tiny_hf_model(seed=seed, vocab=vocab), seed=seed + 100)
    config = EngineConfig(max_sessions=slots, max_seq_len=max_seq_len)
    return Engine.from_hf(head, None, config, "eagle", fuse=fuse)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_feature_draft_greedy_equals_the_target(transport):
    async with pair(transport, tiny_engine(seed=0, slots=2), eagle_engine(0)) as route:
        assert route.draft.feature_size == 64  # the draft said it feeds on target states
        for prompt in PROMPTS:
            gen = await run(route, prompt, 30, SPEC, GREEDY)
            assert gen.token_ids == await target_only(0, prompt, 30)
            assert gen.stats.draft_tokens > 0 and gen.stats.history_resends == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_feature_draft_greedy_over_a_small_vocabulary_accepts_paths(transport):
    """Six tokens: a random head guesses right often, so accepted paths (several states a
    round) go through the loop too."""
    target = tiny_engine(seed=4, vocab=VOCAB, slots=2)
    plain = LocalDecoder(TargetRunner(tiny_engine(seed=4, vocab=VOCAB, slots=2), SessionTable(2)))
    accepted = 0
    async with pair(transport, target, eagle_engine(4, vocab=VOCAB)) as route:
        for prompt in ([1, 4, 2], [5, 0, 3, 3, 1, 2, 4]):
            gen = await run(route, prompt, 40, SPEC, GREEDY)
            assert gen.token_ids == (await plain.agenerate(prompt, 40, GREEDY)).token_ids
            accepted += gen.stats.accepted_tokens
    assert accepted >= 10


class FullWidth:
    """An engine whose forwards spread their logits over the whole vocabulary (-inf off the
    kept ids) whatever they ask: how drafters read a head before they took its K columns."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def run(self, rows, features=None, kept=False):
        return self.engine.run(rows, features)  # (logits_for, V) per row

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_head_keeping_some_ids_proposes_what_its_full_width_logits_say(temperature):
    """Levels read out over the kept ids alone (K columns mapped back to target ids) give
    the trees, q rows included, that the -inf-spread (V,) logits give."""
    kept = torch.arange(1, 96, 3)  # 32 of the 96 ids, none at its own column
    spec = TreeSpec(depth=3, branching=2, budget=6, temperature=temperature, seed=7)
    history = PROMPTS[1]
    states = Features(
        0,
        torch.randn(len(history), 64, generator=torch.Generator().manual_seed(3)).to(FEATURE_DTYPE),
    )
    trees = []
    for full_width in (False, True):
        head, fuse = init_eagle_head(tiny_hf_model(seed=0), seed=100)
        config = EngineConfig(max_sessions=2, max_seq_len=256)
        engine = Engine.from_hf(head, None, config, "eagle", fuse=fuse, kept=kept)
        drafter = FeatureDrafter(FullWidth(engine) if full_width else engine, SessionTable(2))
        if full_width:
            drafter.ids = None  # its columns are the target ids
        (tree,) = drafter.propose([ProposeCall("s", 0, history, spec, features=states)])
        trees.append(tree)
    fast, spread = trees
    assert len(fast) == 6 and set(fast.tokens.tolist()) <= set(kept.tolist())
    assert torch.equal(fast.tokens, spread.tokens) and torch.equal(fast.parents, spread.parents)
    if temperature:
        assert torch.equal(fast.q_tokens, spread.q_tokens)
        torch.testing.assert_close(fast.q_probs, spread.q_probs)
    else:
        assert fast.q_tokens is None and spread.q_tokens is None


class Recording(FeatureDrafter):
    """Records the states each level-0 forward pairs the committed tokens with."""

    def __init__(self, engine, table):
        super().__init__(engine, table)
        self.fed: list[tuple[int, torch.Tensor]] = []  # (first position, (n, E) states)

    def inputs(self, x, n):
        states = super().inputs(x, n)
        if -1 in x.plan:
            self.fed.append((x.session.cached, states))
        return states


async def test_the_head_pairs_each_committed_token_with_the_targets_state_before_it():
    prompt, n = PROMPTS[1], 30
    head = Recording(eagle_engine(0), SessionTable(2))
    target = InProcessTarget("t", TargetRunner(tiny_engine(seed=0, slots=2), SessionTable(2)))
    route = await Pair.of(target, InProcessDraft("d", head, threaded=False))
    loop = Loop(LoopState(Plan(prompt, n, GREEDY, SPEC)), route, uuid.uuid4().hex)
    async for _ in loop.rounds():
        pass
    history = loop.state.history
    # the target's states over the whole history, in one prefill: (L - 1, E)
    call = VerifyCall("all", 0, history, TokenTree.empty(), GREEDY, return_hidden=True)
    (whole,) = TargetRunner(tiny_engine(seed=0, slots=2), SessionTable(2)).verify([call])
    truth = whole.hidden.states.float()
    assert head.fed and head.fed[0][0] == 0  # the first propose came after the first verify
    positions = []
    for first, states in head.fed:
        for i, row in enumerate(states):
            position = first + i
            if position == 0:
                assert not row.any()  # nothing comes before the first token
            else:
                torch.testing.assert_close(row, truth[position - 1], atol=0.05, rtol=0.02)
            positions.append(position)
    # each committed token fed once, in order (the last round's after the last propose)
    assert positions == list(range(len(positions))) and len(positions) > len(prompt)


def test_a_prompt_fed_in_chunks_returns_the_states_of_every_chunk():
    """With a prefill chunk the answer brings the state after every prompt token, the
    earlier chunks' too (those of the prompt fed at once), the newest HIDDEN_BYTES' worth."""
    prompt = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    call = VerifyCall("s", 0, prompt, TokenTree.empty(), GREEDY, return_hidden=True)
    (whole,) = TargetRunner(tiny_engine(seed=0, slots=2), SessionTable(2)).verify([call])
    for hidden_bytes, first in ((1 << 20, 0), (2 * 64 * 10, 20)):  # all 30 rows, the last 10
        runner = TargetRunner(
            tiny_engine(seed=0, slots=2), SessionTable(2), prefill_chunk=8,
            hidden_bytes=hidden_bytes,
        )  # fmt: skip
        unfinished = 0
        while (out := runner.verify([call])[0]) is UNFINISHED:
            unfinished += 1
        assert unfinished == 3 and out.emitted == whole.emitted  # chunks of 8, 8, 8, then 6
        assert out.hidden.start == first
        assert torch.equal(out.hidden.states, whole.hidden.states[first:])


def test_the_target_returns_its_states_of_the_committed_positions():
    """Row i is the state after token start + i, before the final norm: the target's own
    next-token logits come out of it, and every position but the bonus token's is there."""
    engine = tiny_engine(seed=0, slots=2)
    runner = TargetRunner(engine, SessionTable(2))
    prompt = PROMPTS[0]
    call = VerifyCall("s", 0, prompt, TokenTree.empty(), GREEDY, return_hidden=True)
    (first,) = runner.verify([call])
    assert first.hidden.start == 0 and first.hidden.states.shape == (len(prompt), 64)
    logits = engine.model.logits(first.hidden.states[-1:].to(engine.device, torch.float32))
    assert int(logits.argmax()) == first.emitted[0]
    tree = TokenTree(torch.tensor([first.emitted[0], 3]), torch.tensor([-1, 0]))
    history = prompt + first.emitted
    call = VerifyCall("s", len(history), [], tree, GREEDY, return_hidden=True)
    (second,) = runner.verify([call])
    assert second.hidden.start == len(history) - 1  # the root, re-fed
    assert second.hidden.states.shape[0] == len(second.emitted)
    (plain,) = runner.verify(
        [VerifyCall("s", len(history) + len(second.emitted), [], tree, GREEDY)]
    )
    assert plain.hidden is None  # nobody asked: nothing is sent


def test_a_feature_session_gets_the_states_of_a_prefix_another_session_cached():
    """Prefix caching shares KV blocks, not states: a session that asks for states feeds a
    shared prefix again, so its draft gets every prompt position's state, not zeros."""
    engine = tiny_engine(seed=0, slots=3)
    runner = TargetRunner(engine, SessionTable(3))
    prompt = [(7 * i + 3) % 90 + 1 for i in range(40)]  # 2.5 KV blocks
    (plain,) = runner.verify([VerifyCall("a", 0, prompt, TokenTree.empty(), GREEDY)])
    shared = VerifyCall("b", 0, prompt, TokenTree.empty(), GREEDY)
    assert runner.verify([shared])[0].prefix_hit > 0  # the prefix is shared
    call = VerifyCall("c", 0, prompt, TokenTree.empty(), GREEDY, return_hidden=True)
    (fed,) = runner.verify([call])
    assert fed.prefix_hit == 0 and fed.emitted == plain.emitted
    assert fed.hidden.start == 0 and fed.hidden.end == len(prompt)
    (alone,) = TargetRunner(tiny_engine(seed=0, slots=1), SessionTable(1)).verify([call])
    assert torch.equal(fed.hidden.states, alone.hidden.states)


def test_a_long_prefill_returns_only_its_newest_states_within_the_byte_budget():
    prompt = PROMPTS[1]  # 12 tokens; a budget of 5 rows of 64 bfloat16 values
    runner = TargetRunner(tiny_engine(seed=0, slots=2), SessionTable(2), hidden_bytes=5 * 128)
    call = VerifyCall("s", 0, prompt, TokenTree.empty(), GREEDY, return_hidden=True)
    (out,) = runner.verify([call])
    assert out.hidden.start == len(prompt) - 5 and out.hidden.end == len(prompt)
    (whole,) = TargetRunner(tiny_engine(seed=0, slots=2), SessionTable(2)).verify([call])
    assert torch.equal(out.hidden.states, whole.hidden.states[-5:])


def test_hidden_states_round_trip_the_wire_bit_for_bit():
    values = torch.randn(5, 64) * torch.logspace(-40, 38, 64)  # (5, E): tiny to huge
    values[0, :4] = torch.tensor([float("inf"), float("-inf"), -0.0, float("nan")])
    states = values.to(FEATURE_DTYPE)
    outcome = VerifyOutcome([], [1], None, 0, hidden=Features(7, states))
    wire = pb.VerifyResponse.FromString(convert.verify_response(outcome).SerializeToString())
    assert len(wire.hidden.data) == 2 * states.numel()  # two bytes a value
    back = convert.verify_outcome(wire).hidden
    assert back.start == 7 and back.states.dtype == FEATURE_DTYPE
    assert torch.equal(back.states.view(torch.int16), states.view(torch.int16))
    empty = Features(3, torch.empty(0, 64, dtype=FEATURE_DTYPE))
    assert convert.features_from_proto(convert.features_to_proto(empty)).states.shape == (0, 64)


async def test_hidden_states_over_grpc_equal_the_in_process_ones():
    prompt = PROMPTS[1]
    call = VerifyCall("s", 0, prompt, TokenTree.empty(), GREEDY, return_hidden=True)
    (local,) = TargetRunner(tiny_engine(seed=0, slots=2), SessionTable(2)).verify([call])
    async with target_worker(tiny_engine(seed=0, slots=2)) as (_, target):
        remote = await target.verify(call)
    assert remote.hidden.start == local.hidden.start
    assert torch.equal(
        remote.hidden.states.view(torch.int16), local.hidden.states.view(torch.int16)
    )


def test_features_fill_positions_they_do_not_cover_with_zeros():
    states = torch.arange(6, dtype=torch.float32).view(3, 2).to(FEATURE_DTYPE)  # (3, 2)
    out = Features(4, states).at(range(3, 8), 2)  # positions 3..7; 4..6 covered
    assert out[:, 0].tolist() == [0.0, 0.0, 2.0, 4.0, 0.0]


async def test_a_draft_that_lost_the_session_recovers_and_the_output_stays_exact():
    """Evicting the session from the draft after every other round: it comes back with the
    whole history and only the latest round's states, and proposes on."""
    prompt, n = PROMPTS[0], 30
    head = FeatureDrafter(eagle_engine(0), SessionTable(2))
    target = InProcessTarget("t", TargetRunner(tiny_engine(seed=0, slots=2), SessionTable(2)))
    route = await Pair.of(target, InProcessDraft("d", head, threaded=False))
    loop = Loop(LoopState(Plan(prompt, n, GREEDY, SPEC)), route, uuid.uuid4().hex)
    rounds = 0
    async for _ in loop.rounds():
        rounds += 1
        if rounds % 2 == 0:
            head.end(loop.session_id)
    assert loop.state.generated == await target_only(0, prompt, n)
    assert loop.counters.history_resends >= 2 and loop.counters.draft_tokens > 0


def test_a_head_directory_says_its_kind_and_loads_as_a_feature_draft(tmp_path):
    from tests.gateway.helpers import word_tokenizer, write_tiny_model

    target_dir = write_tiny_model(tmp_path / "target")
    from transformers import AutoModelForCausalLM

    head, fuse = init_eagle_head(AutoModelForCausalLM.from_pretrained(target_dir), seed=3)
    head_dir = save_eagle_head(tmp_path / "head", head, fuse, word_tokenizer())
    assert draft_kind(head_dir) == "eagle" and draft_kind(target_dir) == "model"
    config = EngineConfig(model=str(head_dir), max_sessions=2, max_seq_len=64)
    engine = Engine.load(config)
    assert isinstance(engine.model, EagleHead)
    target = Engine.load(EngineConfig(model=str(target_dir), max_sessions=2, max_seq_len=64))
    draft_info = drafter(engine).info()
    assert draft_info.feature_size == target.info("target", 0, 0).feature_size == 64
    check_pair(draft_info, target.info("target", 0, 0))
    assert torch.equal(engine.model.embed.weight, target.model.embed.weight)


def test_a_feature_draft_pairs_only_with_a_target_of_its_width():
    draft = WorkerInfo("draft", "eagle", "vocab:96", 96, 256, 2, feature_size=64)
    wide = WorkerInfo("target", "big", "vocab:96", 96, 256, 2, feature_size=128)
    with pytest.raises(IncompatibleWorkers, match="width"):
        check_pair(draft, wide)


def test_states_of_another_width_fail_only_their_own_call():
    head = FeatureDrafter(eagle_engine(0), SessionTable(2))
    prompt = PROMPTS[0]
    right = Features(0, torch.zeros(len(prompt) - 1, 64, dtype=FEATURE_DTYPE))
    wrong = Features(0, torch.zeros(len(prompt) - 1, 32, dtype=FEATURE_DTYPE))
    good, bad = head.propose(
        [
            ProposeCall("a", 0, prompt, SPEC, features=right),
            ProposeCall("b", 0, prompt, SPEC, features=wrong),
        ]
    )
    assert isinstance(bad, ValueError) and "width" in str(bad)
    assert len(good) > 0


def test_a_head_prefills_a_long_history_in_chunks_with_its_states():
    """Chunks pair each token with its state as the whole history would: same tree, same
    cache entries."""
    history = torch.randint(1, 96, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    gen = torch.Generator().manual_seed(6)
    states = Features(0, torch.randn(69, 64, generator=gen).to(FEATURE_DTYPE))  # (L - 1, E)
    call = ProposeCall("p", 0, history, SPEC, features=states)
    chunked = FeatureDrafter(eagle_engine(0), SessionTable(2), prefill_chunk=32)
    steps = [chunked.propose([call]) for _ in range(3)]
    assert [s[0] is UNFINISHED for s in steps] == [True, True, False]
    whole = FeatureDrafter(eagle_engine(0), SessionTable(2))
    (tree,) = whole.propose([call])
    assert steps[2][0].tokens.tolist() == tree.tokens.tolist()
    assert steps[2][0].parents.tolist() == tree.parents.tolist()
    ours = chunked.engine.cache.entries(chunked.table.get("p").slot, 70)
    theirs = whole.engine.cache.entries(whole.table.get("p").slot, 70)
    torch.testing.assert_close(ours[0], theirs[0], atol=1e-4, rtol=1e-4)


async def test_the_draft_worker_says_it_feeds_on_features():
    async with draft_worker(eagle_engine(1)) as (_, remote):
        assert (await remote.info()).feature_size == 64


# --- sampling: the target's distribution, through the feature path ----------------------

CONCURRENT = 16


async def sampled_counts(transport: str, acceptance: AcceptanceRule) -> torch.Tensor:
    target = tiny_engine(seed=4, vocab=VOCAB, slots=CONCURRENT)
    head = eagle_engine(4, vocab=VOCAB, slots=CONCURRENT, max_seq_len=64)
    counts = torch.zeros(VOCAB, VOCAB)
    tree = TreeSpec(depth=2, branching=3, budget=8)

    async def one(route, seed: int) -> list[int]:
        params = SamplingParams(SAMPLED.temperature, seed=seed)
        plan = Plan(PROMPT, 3, params, tree, acceptance=acceptance)
        loop = Loop(LoopState(plan), route, uuid.uuid4().hex)
        async for _ in loop.rounds():
            pass
        assert loop.counters.draft_tokens > 0  # the head drafted from the target's states
        return loop.state.generated

    async with pair(transport, target, head, concurrent=True) as route:
        for first in range(0, RUNS, CONCURRENT):
            seeds = range(first, min(first + CONCURRENT, RUNS))
            for out in await asyncio.gather(*(one(route, seed) for seed in seeds)):
                counts[out[0], out[1]] += 1
    return counts


def chi_square_p(counts: torch.Tensor) -> float:
    expected = exact_distribution(tiny_hf_model(vocab=VOCAB, seed=4), SAMPLED)
    cells = [(a, b) for a, b in itertools.product(range(VOCAB), repeat=2) if expected[a, b] > 0]
    observed = [float(counts[a, b]) for a, b in cells]
    wanted = [float(expected[a, b]) * RUNS for a, b in cells]
    scale = sum(observed) / sum(wanted)
    return chisquare(observed, [w * scale for w in wanted]).pvalue


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_feature_draft_samples_follow_the_target_distribution(transport):
    counts = await sampled_counts(transport, AcceptanceRule())
    assert counts.sum() == RUNS
    assert chi_square_p(counts) > 1e-3


async def test_the_same_test_rejects_a_lossy_verification():
    """Power: the feature path with a lossy acceptance rule must fail the test decisively."""
    counts = await sampled_counts("inprocess", AcceptanceRule("threshold", threshold=0.05))
    assert chi_square_p(counts) < 1e-6


def test_a_feature_session_takes_a_prefix_whose_states_another_feature_session_left():
    """The target keeps the states of the full blocks a feature session's answer covered:
    another feature session on the same prefix takes those blocks' KV and their states, and
    gets the states and tokens an unshared prefill gives, chunked or not; not under another
    salt, and not once the states' budget has dropped them."""
    prompt = [(7 * i + 3) % 90 + 1 for i in range(40)]  # 2.5 KV blocks of 16
    other = prompt[:36] + [1, 2, 3, 4]  # the first two blocks in common

    def call(session: str, tokens: list[int], salt: str = "") -> VerifyCall:
        return VerifyCall(session, 0, tokens, TokenTree.empty(), GREEDY, return_hidden=True)

    def answer(runner: TargetRunner, c: VerifyCall) -> VerifyOutcome:
        while (out := runner.verify([c])[0]) is UNFINISHED:
            pass
        return out

    (alone,) = TargetRunner(tiny_engine(seed=0, slots=1), SessionTable(1)).verify(
        [call("x", other)]
    )
    for chunk in (None, 8):
        runner = TargetRunner(tiny_engine(seed=0, slots=4), SessionTable(4), prefill_chunk=chunk)
        assert answer(runner, call("a", prompt)).prefix_hit == 0
        shared = answer(runner, call("b", other))
        assert shared.prefix_hit == 32 and shared.emitted == alone.emitted
        assert shared.hidden.start == 0
        assert torch.equal(shared.hidden.states, alone.hidden.states)
        assert answer(runner, replace(call("c", other), cache_salt="t")).prefix_hit == 0
    tight = TargetRunner(tiny_engine(seed=0, slots=4), SessionTable(4), state_bytes=16 * 64 * 2)
    answer(tight, call("a", prompt))  # keeps one block's states: the second
    assert answer(tight, call("b", other)).prefix_hit == 0


def test_a_conversations_next_turn_takes_its_earlier_answers_states():
    """The states of a feature session's answer are kept block by block as its rounds
    complete them: the conversation's next turn (a new session on the whole history) takes
    the KV and states of the blocks its earlier answer filled, as an unshared prefill has
    them."""
    prompt = [(7 * i + 3) % 90 + 1 for i in range(20)]
    runner = TargetRunner(tiny_engine(seed=0, slots=4), SessionTable(4))
    call = VerifyCall("turn1", 0, prompt, TokenTree.empty(), GREEDY, return_hidden=True)
    history = prompt + runner.verify([call])[0].emitted
    while len(history) < 52:  # plain decode rounds, one token each
        step = VerifyCall("turn1", len(history), [], TokenTree.empty(), GREEDY, return_hidden=True)
        history += runner.verify([step])[0].emitted
    runner.end("turn1")
    turn2 = history + [5, 6, 7]
    call = VerifyCall("turn2", 0, turn2, TokenTree.empty(), GREEDY, return_hidden=True)
    (second,) = runner.verify([call])
    assert second.prefix_hit == 48  # three blocks, the last two filled by the answer
    (alone,) = TargetRunner(tiny_engine(seed=0, slots=1), SessionTable(1)).verify([call])
    assert second.emitted == alone.emitted and second.hidden.start == 0
    torch.testing.assert_close(second.hidden.states, alone.hidden.states, atol=0, rtol=0)


async def test_a_target_workers_prefix_state_budget_is_its_flag():
    for mib, reused in ((1, 32), (0, 0)):
        async with target_worker(tiny_engine(seed=0, slots=4), prefix_state_mib=mib) as (
            server,
            target,
        ):
            assert server.servicer.runner.states.max_bytes == mib << 20
            prompt = [(7 * i + 3) % 90 + 1 for i in range(40)]
            for session in ("a", "b"):
                call = VerifyCall(session, 0, prompt, TokenTree.empty(), GREEDY, return_hidden=True)
                outcome = await target.verify(call)
            assert outcome.prefix_hit == reused  # 0 MiB: b feeds its whole prompt again
