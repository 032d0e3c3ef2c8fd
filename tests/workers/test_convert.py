"""Messages <-> dataclasses: what goes through the wire comes back equal."""

from dataclasses import replace

import pytest
import torch

from workers.protocol import (
    IncompatibleWorkers,
    ProposeCall,
    TokenLogprob,
    TreeSpec,
    VerifyCall,
    VerifyOutcome,
    check_pair,
)
from workers.rpc import convert
from workers.speculation.acceptance import EXACT, AcceptanceRule
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree, TreeError


def sampled_tree() -> TokenTree:
    q_probs = torch.tensor([[0.7, 0.3, 0.0], [0.6, 0.4, 0.0], [1 / 3, 1 / 3, 1 / 3]])  # (3, 3)
    return TokenTree(
        tokens=torch.tensor([4, 9, 2]),
        parents=torch.tensor([-1, -1, 0]),
        q_tokens=torch.tensor([[4, 9, 0], [9, 1, 0], [2, 3, 5]]),
        q_probs=q_probs,
    )


def same_tree(a: TokenTree, b: TokenTree) -> bool:
    if not (torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)):
        return False
    if a.q_tokens is None or b.q_tokens is None:
        return a.q_tokens is None and b.q_tokens is None
    return torch.equal(a.q_tokens, b.q_tokens) and torch.equal(a.q_probs, b.q_probs)


@pytest.mark.parametrize("tree", [TokenTree.empty(), TokenTree.chain([5, 6, 7]), sampled_tree()])
def test_trees_round_trip(tree):
    assert same_tree(convert.tree_from_proto(convert.tree_to_proto(tree)), tree)


def test_verify_call_round_trips():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=3, min_p=0.05)
    call = VerifyCall("s", 4, [1, 2], sampled_tree(), params, num_logprobs=2, cache_salt="k\n")
    back = convert.verify_call(convert.verify_request(call))
    assert (back.session_id, back.base_len, back.tokens) == ("s", 4, [1, 2])
    assert back.cache_salt == "k\n"
    assert back.params == params and back.num_logprobs == 2
    assert same_tree(back.tree, call.tree)
    plain = convert.verify_call(
        convert.verify_request(VerifyCall("s", 0, [1], TokenTree.empty(), SamplingParams()))
    )
    assert plain.params == SamplingParams() and plain.num_logprobs == -1
    assert plain.acceptance == EXACT


@pytest.mark.parametrize(
    "rule", [AcceptanceRule("threshold", threshold=0.25), AcceptanceRule("typical", 0.1, 0.2, 0.5)]
)
def test_a_lossy_rule_travels_with_the_verify_call(rule):
    call = VerifyCall("s", 0, [1], TokenTree.empty(), SamplingParams(), acceptance=rule)
    assert convert.verify_call(convert.verify_request(call)).acceptance == rule


def test_propose_call_round_trips():
    call = ProposeCall(
        "s", 0, [3, 1], TreeSpec(depth=5, branching=3, budget=12, temperature=0.5, seed=1)
    )
    assert convert.propose_call(convert.propose_request(call)) == call
    salted = ProposeCall("s", 0, [3], TreeSpec(), cache_salt="tenant\nsalt")
    assert convert.propose_call(convert.propose_request(salted)) == salted


def test_outcome_round_trips():
    logprobs = [TokenLogprob(4, -0.5, [(4, -0.5), (9, -1.25)])] * 3
    outcome = VerifyOutcome([0, 2], [4, 2, 8], logprobs, 7, convert.Timings(10, 20, 3))
    msg = convert.verify_response(outcome)
    assert msg.bonus == 8
    assert convert.verify_outcome(msg) == outcome


def test_malformed_q_rows_are_rejected():
    msg = convert.tree_to_proto(sampled_tree())
    del msg.q_probs[-1]
    with pytest.raises(TreeError, match="N \\* K"):
        convert.tree_from_proto(msg)


def info(role: str, fingerprint: str) -> convert.WorkerInfo:
    return convert.WorkerInfo(role, "m", fingerprint, 96, 256, 4, 0, (2,), 64)


def test_check_pair():
    check_pair(info("draft", "abc"), info("target", "abc"))
    check_pair(info("draft", ""), info("target", "abc"))  # model-free drafts pair with any target
    assert convert.info_from_proto(convert.info_to_proto(info("draft", "x"))) == info("draft", "x")
    for rows in (None, 0, 16):  # a target's cheap rows: not stated, none, the tile unit's
        target = replace(info("target", "x"), lookup_rows=rows)
        assert convert.info_from_proto(convert.info_to_proto(target)) == target
    with pytest.raises(IncompatibleWorkers, match="different tokenizers"):
        check_pair(info("draft", "abc"), info("target", "abd"))
    with pytest.raises(IncompatibleWorkers, match="a draft and a target"):
        check_pair(info("target", "abc"), info("target", "abc"))
