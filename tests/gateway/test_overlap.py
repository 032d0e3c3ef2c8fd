"""The overlapped loop: look-ahead trees, the draft's rollback, and unchanged output."""

from __future__ import annotations

import asyncio

import pytest
import torch
from openai import OpenAI

from gateway.overlap import Lookahead
from tests.engine.tiny import tiny_engine
from tests.gateway.helpers import MODEL, live, model_draft, target
from workers.draft.ngram import NgramDrafter
from workers.draft.runner import ModelDrafter
from workers.engine.sessions import SessionTable
from workers.protocol import ProposeCall, TreeSpec
from workers.speculation.tree import TokenTree, spine, subtree


def tree(tokens: list[int], parents: list[int], q: bool = False) -> TokenTree:
    n = len(tokens)
    q_tokens = torch.arange(n * 2).reshape(n, 2) if q else None
    q_probs = torch.full((n, 2), 0.5) if q else None
    return TokenTree(
        torch.tensor(tokens, dtype=torch.long),
        torch.tensor(parents, dtype=torch.long),
        q_tokens,
        q_probs,
    )


#       root
#      /    \
#    0:10   1:11
#    /  \      \
#  2:20 3:21   4:30
#   |
#  5:40
EXAMPLE = ([10, 11, 20, 21, 30, 40], [-1, -1, 0, 0, 1, 2])


def test_spine_follows_first_children():
    assert spine(tree(*EXAMPLE)) == [10, 20, 40]
    assert spine(TokenTree.empty()) == []


def test_subtree_below_a_path():
    under = subtree(tree(*EXAMPLE, q=True), [10], budget=16)
    assert under.tokens.tolist() == [20, 21, 40]
    assert under.parents.tolist() == [-1, -1, 0]
    assert under.q_tokens.tolist() == [[4, 5], [6, 7], [10, 11]]  # rows follow their nodes
    assert subtree(tree(*EXAMPLE), [11], budget=16).tokens.tolist() == [30]
    assert subtree(tree(*EXAMPLE), [10, 20], budget=16).tokens.tolist() == [40]
    assert subtree(tree(*EXAMPLE), [10], budget=2).tokens.tolist() == [20, 21]  # closed prefix
    assert subtree(tree(*EXAMPLE), [99], budget=16) is None  # not in the tree
    assert subtree(tree(*EXAMPLE), [11, 30], budget=16) is None  # nothing below


async def test_lookahead_needs_the_guess_then_a_path_of_its_tree():
    async def nothing():
        return None

    ahead = Lookahead(5, [7], 3, 8, None, asyncio.ensure_future(nothing()))
    ahead_tree = tree(*EXAMPLE)  # drafted after the guess 7
    assert ahead.next_tree(ahead_tree, [7, 10]).tokens.tolist() == [20, 21, 40]
    assert ahead.next_tree(ahead_tree, [7, 10, 20]).tokens.tolist() == [40]
    assert ahead.next_tree(ahead_tree, [7, 10, 21]) is None  # nothing below 21
    assert ahead.next_tree(ahead_tree, [8, 10, 20]) is None  # not the guess
    assert ahead.next_tree(ahead_tree, [7]) is None  # cut short (stop token, max_tokens)
    assert await ahead.result() is None


@pytest.mark.parametrize("kind", ["model", "ngram"])
def test_a_rolled_back_draft_proposes_as_if_it_never_guessed(kind):
    """A draft that ran ahead on a wrong guess and was rolled back matches a fresh one."""
    history = [5, 9, 14, 5, 9, 22, 31, 5, 9, 14, 40, 41, 5, 9]
    guess = [14, 40, 41, 5]  # the draft is told this was committed ...
    truth = [14, 40, 7, 3]  # ... but the target committed this
    spec = TreeSpec(depth=4, branching=2, budget=8)

    def drafter():
        if kind == "ngram":
            return NgramDrafter(SessionTable(2))
        return ModelDrafter(tiny_engine(seed=3), SessionTable(2))

    ran_ahead, fresh = drafter(), drafter()
    ran_ahead.propose([ProposeCall("s", 0, history, spec)])
    ran_ahead.propose([ProposeCall("s", len(history), guess, spec)])
    agree = 2  # common prefix of guess and truth
    (got,) = ran_ahead.propose([ProposeCall("s", len(history) + agree, truth[agree:], spec)])
    fresh.propose([ProposeCall("s", 0, history, spec)])
    (want,) = fresh.propose([ProposeCall("s", len(history), truth, spec)])
    assert got.tokens.tolist() == want.tokens.tolist()
    assert got.parents.tolist() == want.parents.tolist()


@pytest.fixture(scope="module")
def replies(tiny_dir, tiny_draft_dir):
    """Greedy replies with the overlapped loop off and on, model draft and n-gram draft.

    The tree is the configured one (no adaptive shaping): adapted trees follow measured
    round times, and which guesses come true would then vary with the machine's load."""
    prompts = ["one two three one two three one", "hello world , the cat sat on the mat"]
    out = {}
    for draft in ("model", "ngram"):
        for overlap in (False, True):
            backends = [target(tiny_dir)]
            if draft == "model":
                backends.append(model_draft(tiny_draft_dir))
            with live(tiny_dir, backends, overlap_draft=overlap, adaptive_tree=False) as gateway:
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
            out[draft, overlap] = texts, stats
    return out


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_overlapped_loop_does_not_change_the_output(replies, draft):
    plain, _ = replies[draft, False]
    overlapped, stats = replies[draft, True]
    assert overlapped == plain
    assert sum(s["lookahead_hits"] + s["lookahead_misses"] for s in stats) > 0


def test_model_draft_guesses_come_true(replies):
    _, stats = replies["model", True]
    assert sum(s["lookahead_hits"] for s in stats) > 0
    assert sum(s["lookahead_misses"] for s in stats) > 0
