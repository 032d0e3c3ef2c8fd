"""Decode steps (VerifyCall.steps): a round without a draft has the target decode several
tokens in a row before it answers. Each token is the one a call of its own would have got,
greedy or sampled; the answers come after the same forwards for sessions side by side; a
stop token ends the steps; and through the loop, over real gRPC workers, the text is the
target's own."""

import asyncio
from dataclasses import replace

import pytest
import torch

from tests.decoding.pairs import NGRAM, pair, run
from tests.decoding.test_greedy_lossless import GREEDY, target_only
from tests.engine.tiny import tiny_engine
from workers.engine.sessions import SessionTable
from workers.protocol import UNFINISHED, VerifyCall, VerifyOutcome
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree
from workers.target import runner as runner_module
from workers.target.runner import TargetRunner

PROMPT = [5, 9, 2, 7, 7, 1, 30, 4]
SAMPLED = SamplingParams(temperature=1.0, seed=11)


def runner(slots: int = 2) -> TargetRunner:
    return TargetRunner(tiny_engine(seed=0, slots=slots), SessionTable(slots))


def single_steps(params: SamplingParams, n: int) -> tuple[list[int], list[float]]:
    """The prompt's first n tokens, one call a token, and each token's logprob."""
    target = runner()
    tokens, logprobs = [], []
    call = VerifyCall("s", 0, PROMPT, TokenTree.empty(), params, num_logprobs=2)
    for _ in range(n):
        (out,) = target.verify([call])
        tokens += out.emitted
        logprobs += [lp.logprob for lp in out.logprobs]
        call = VerifyCall("s", len(PROMPT) + len(tokens), [], call.tree, params, 2)
    return tokens, logprobs


def answered(target: TargetRunner, calls: list[VerifyCall]) -> list[tuple[int, VerifyOutcome]]:
    """Runs the calls' steps until every call is answered: (the forward it came after, its
    answer) per call."""
    results: list[tuple[int, VerifyOutcome] | None] = [None] * len(calls)
    while any(r is None for r in results):
        waiting = [i for i, r in enumerate(results) if r is None]
        for i, out in zip(waiting, target.verify([calls[i] for i in waiting]), strict=True):
            if out is not UNFINISHED:
                assert isinstance(out, VerifyOutcome)
                results[i] = (target.forwards, out)
    return results  # type: ignore[return-value]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_decode_steps_give_the_tokens_of_single_steps(params):
    expected, expected_logprobs = single_steps(params, 12)
    target = runner()
    (first,) = target.verify([VerifyCall("s", 0, PROMPT, TokenTree.empty(), params, 2)])
    tokens, logprobs = list(first.emitted), [lp.logprob for lp in first.logprobs]
    sizes = []
    while len(tokens) < len(expected):
        held = len(PROMPT) + len(tokens)  # the worker holds every token it answered
        call = VerifyCall("s", held, [], TokenTree.empty(), params, 2, steps=4)
        ((after, out),) = answered(target, [call])
        assert after % 4 == 0 and out.steps == len(out.emitted) and not out.accepted
        tokens += out.emitted
        logprobs += [lp.logprob for lp in out.logprobs]
        sizes.append(len(out.emitted))
    assert tokens[: len(expected)] == expected
    assert torch.allclose(torch.tensor(logprobs[:12]), torch.tensor(expected_logprobs))
    assert sizes[0] == 3 and set(sizes[1:]) == {4}  # the first answer lines up with forward 4


def test_sessions_decoding_side_by_side_are_answered_after_the_same_forward():
    target = runner(slots=3)
    starts = [
        VerifyCall(s, 0, PROMPT[: 4 + i], TokenTree.empty(), GREEDY) for i, s in enumerate("abc")
    ]
    outs = target.verify(starts)  # forward 1
    calls = [
        VerifyCall(c.session_id, len(c.tokens) + 1, [], TokenTree.empty(), GREEDY, steps=8)
        for c, o in zip(starts, outs, strict=True)
    ]
    late = calls.pop()  # joins at forward 3
    (early,) = target.verify([calls[0]])  # forward 2: a step of a's alone
    assert early is UNFINISHED
    answers = answered(target, [calls[0], calls[1], late])
    assert {after for after, _ in answers} == {8}
    assert [len(out.emitted) for _, out in answers] == [7, 6, 6]


def test_a_stop_token_ends_the_steps():
    expected, _ = single_steps(GREEDY, 6)
    target = runner()
    (first,) = target.verify([VerifyCall("s", 0, PROMPT, TokenTree.empty(), GREEDY)])
    stop = expected[3]
    n = expected[1:].index(stop) + 1  # tokens up to the first stop token, after the first
    held = len(PROMPT) + 1
    call = VerifyCall("s", held, [], TokenTree.empty(), GREEDY, steps=64, stop_ids=(stop,))
    ((_, out),) = answered(target, [call])
    assert first.emitted + out.emitted == expected[: n + 1]


def test_a_call_that_ends_its_generation_is_not_due_until_its_session_calls_again():
    """A call whose steps end its generation (here its `most` tokens: the gateway's is what
    the request still wants) leaves the sessions the batcher waits for (`due_sessions`)
    until its session calls again; one answered after its steps stays due."""
    target = runner()
    target.verify([VerifyCall(s, 0, PROMPT, TokenTree.empty(), GREEDY) for s in "ab"])
    held = len(PROMPT) + 1
    calls = [
        VerifyCall("a", held, [], TokenTree.empty(), GREEDY, steps=4, most=2),
        VerifyCall("b", held, [], TokenTree.empty(), GREEDY, steps=4),
    ]
    (_, a), (_, b) = answered(target, calls)
    assert len(a.emitted) == 2 and len(b.emitted) == 3  # b: up to the fourth forward
    assert target.due_sessions() == ["b"]
    target.verify([VerifyCall("a", held + 2, [], TokenTree.empty(), GREEDY)])
    assert sorted(target.due_sessions()) == ["a", "b"]


def test_a_tree_or_one_step_answers_after_one_forward():
    target = runner()
    (first,) = target.verify([VerifyCall("s", 0, PROMPT, TokenTree.empty(), GREEDY)])
    tree = TokenTree(torch.tensor([3]), torch.tensor([-1]))
    (out,) = target.verify([VerifyCall("s", len(PROMPT) + 1, [], tree, GREEDY, steps=4)])
    assert isinstance(out, VerifyOutcome) and out.steps == 1
    with pytest.raises(ValueError, match="steps"):
        VerifyCall("s", 0, PROMPT, TokenTree.empty(), GREEDY, steps=0)


@pytest.mark.parametrize("draft", [None, NGRAM], ids=["no-draft", "ngram"])
async def test_the_loop_with_decode_steps_over_grpc_gives_the_targets_greedy_text(draft):
    """Three sessions at once through real gRPC workers, the loop asking for 4 steps a round
    without a draft: each text is the target's own."""
    prompts = [PROMPT, PROMPT[:5] * 3, [40, 41, 42, 40, 41]]
    async with pair("grpc", tiny_engine(seed=0, slots=4), draft, batch_wait_ms=5) as route:
        gens = await asyncio.gather(*(run(route, p, 21, steps=4) for p in prompts))
    for prompt, gen in zip(prompts, gens, strict=True):
        assert gen.token_ids == await target_only(0, prompt, 21)
        assert gen.stats.verify_steps >= gen.stats.emitted_tokens - gen.stats.accepted_tokens


# --- the target's own lookups during decode steps (VerifyCall.lookup) ----------------------

# prompts whose greedy continuations on the tiny target repeat 3-token runs of the history
LOOKUP_PROMPTS = [[40, 41, 42, 40, 41], [5, 9, 2, 7, 7] * 3, PROMPT]


def looked_up(
    prompt: list[int], n: int, lookup: int, rows: int, params: SamplingParams = GREEDY
) -> tuple[list[int], list[VerifyOutcome]]:
    """The prompt's first n tokens: a first call, then calls of 4 steps with `lookup`."""
    target = TargetRunner(tiny_engine(seed=0, slots=2), SessionTable(2), lookup_rows=rows)
    (first,) = target.verify([VerifyCall("s", 0, prompt, TokenTree.empty(), params)])
    tokens, outs = list(first.emitted), []
    while len(tokens) < n:
        held, most = len(prompt) + len(tokens), n - len(tokens)
        call = VerifyCall(
            "s", held, [], TokenTree.empty(), params, steps=4, lookup=lookup, most=most
        )
        ((_, out),) = answered(target, [call])
        assert len(out.emitted) <= most and out.steps <= 4
        tokens += out.emitted
        outs.append(out)
    return tokens, outs


def test_decode_steps_own_lookups_give_the_tokens_of_single_steps():
    nodes = accepted = 0
    for prompt in LOOKUP_PROMPTS:
        expected, _ = looked_up(prompt, 40, lookup=0, rows=8)
        tokens, outs = looked_up(prompt, 40, lookup=3, rows=8)
        assert tokens == expected
        for out in outs:
            nodes += out.lookup_nodes
            accepted += len(out.lookup_accepted)
            assert all(0 <= i < len(out.emitted) for i in out.lookup_accepted)
            assert len(out.lookup_accepted) <= out.lookup_nodes
    assert nodes > accepted > 0


def counting_fed(target: TargetRunner) -> list[int]:
    """The tokens each of the target's forwards feeds from now on, appended as they run."""
    fed: list[int] = []
    run = target.engine.run

    def counted(batch):
        fed.append(sum(len(row.tokens) for row in batch))
        return run(batch)

    target.engine.run = counted
    return fed


SIDE_BY_SIDE = [[40, 41, 42, 40, 41], [5, 9, 2, 7, 7] * 3, [7, 8, 9, 7, 8, 9]]
RUN = [5, 9, 2, 7, 7]  # the second prompt's run


def side_by_side(
    target: TargetRunner, lookup: int, copying: bool = False
) -> list[tuple[int, VerifyOutcome]]:
    """The prompts' sessions started, then one call each of 16 steps with `lookup`;
    `copying`: the second session's call first brings the run, its first token x and the
    run again, so that its history (the run three times, x, the run, x, the run) agrees with
    its latest match over 11 tokens."""
    starts = [
        VerifyCall(str(i), 0, p, TokenTree.empty(), GREEDY) for i, p in enumerate(SIDE_BY_SIDE)
    ]
    firsts = target.verify(starts)
    calls = [
        VerifyCall(
            c.session_id, len(c.tokens) + 1, [], TokenTree.empty(), GREEDY, steps=16,
            lookup=lookup, most=16,
        )
        for c in starts
    ]  # fmt: skip
    if copying:
        calls[1] = replace(calls[1], tokens=RUN + firsts[1].emitted + RUN)
    return answered(target, calls)


def test_lookups_fill_only_the_forwards_cheap_rows():
    """Three sessions decoding side by side, long matches aside: with 4 cheap rows a forward
    carries at most one looked-up token beside the three steps, with 3 (or lookups not
    asked) none."""
    for rows, lookup, most_fed in ((4, 3, 4), (3, 3, 3), (8, 0, 3)):
        engine = tiny_engine(seed=0, slots=3)
        target = TargetRunner(engine, SessionTable(3), lookup_rows=rows, long_match=0)
        fed = counting_fed(target)
        answers = side_by_side(target, lookup)
        assert max(fed[1:]) == most_fed
        assert (sum(out.lookup_nodes for _, out in answers) > 0) == (most_fed > 3)


class Recording(TargetRunner):
    """A TargetRunner that notes, for each lookup past the cheap rows, how far its
    session's history agreed with its latest match (up to 64 tokens)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.past: list[int] = []

    def lookup(self, p, free):
        tree = super().lookup(p, free)
        if tree is not None and free < len(tree):
            self.past.append(self.index(p.session).agreement(64))
        return tree


def test_past_the_cheap_rows_only_long_matches_look_up():
    """With the cheap rows full (three sessions, 3 rows), a step looks up only where its
    history agrees with its latest match over `long_match` tokens: the session whose history
    repeats a run does at its first step; with a longer `long_match` than any agreement, or
    0, nothing is looked up; the text is the same either way."""
    texts = []
    for long_match in (6, 64, 0):
        target = Recording(
            tiny_engine(seed=0, slots=3), SessionTable(3), lookup_rows=3, long_match=long_match
        )
        answers = side_by_side(target, lookup=3, copying=True)
        texts.append([out.emitted for _, out in answers])
        nodes = [out.lookup_nodes for _, out in answers]
        if long_match == 6:
            assert nodes[1] > 0 and target.past and min(target.past) >= 6
        else:
            assert not any(nodes) and not target.past
    assert texts[0] == texts[1] == texts[2]


def test_long_matches_look_up_only_while_the_forward_stays_small(monkeypatch):
    """Beside many decode rows a looked-up row costs what an average one does: a long match
    looks up only while the forward feeds at most LONG_ROWS tokens with it (here 5, which
    three sessions' steps and a lookup of 3 exceed)."""
    monkeypatch.setattr(runner_module, "LONG_ROWS", 5)
    target = Recording(tiny_engine(seed=0, slots=3), SessionTable(3), lookup_rows=3)
    answers = side_by_side(target, lookup=3, copying=True)
    assert not any(out.lookup_nodes for _, out in answers) and not target.past


def test_sampled_calls_look_up_only_without_a_seed():
    """A seeded sampled call looks nothing up (a step's room for lookups depends on the
    batch beside it, and the seed alone must fix the text) and gives the tokens of single
    steps; an unseeded one looks up as a greedy one does (its distribution:
    tests/decoding/test_sampling_lossless.py)."""
    prompt = [5, 9, 2, 7, 7] * 3  # ends in a 3-token run seen before: the first step drafts
    tokens, outs = looked_up(prompt, 24, lookup=3, rows=8, params=SAMPLED)
    assert not any(out.lookup_nodes for out in outs)
    assert tokens == looked_up(prompt, 24, lookup=0, rows=8, params=SAMPLED)[0]
    unseeded = SamplingParams(temperature=1.0)
    target = TargetRunner(tiny_engine(seed=0, slots=2), SessionTable(2), lookup_rows=32)
    call = VerifyCall("s", 0, prompt, TokenTree.empty(), unseeded, steps=4, lookup=3, most=8)
    ((_, out),) = answered(target, [call])
    assert out.lookup_nodes > 0 and len(out.emitted) <= 8
