"""Chunked prefill: a long prompt is fed a chunk per step between other sessions' rounds,
on the target and on a model draft, and the tokens (and trees) are those of an unchunked
prefill (greedy, through the real loop)."""

import asyncio

import torch

from tests.decoding.pairs import run
from tests.decoding.test_greedy_lossless import GREEDY, perturbed_draft, target_only
from tests.engine.tiny import tiny_engine
from tests.workers.helpers import draft_worker, target_worker
from workers.draft.runner import ModelDrafter
from workers.engine.sessions import SessionTable
from workers.loop import Pair
from workers.protocol import UNFINISHED, ProposeCall, TreeSpec, VerifyCall, VerifyOutcome
from workers.speculation.tree import TokenTree
from workers.target.runner import TargetRunner

LONG = torch.randint(1, 96, (70,), generator=torch.Generator().manual_seed(5)).tolist()


def test_a_long_prompt_steps_in_chunks_beside_a_decoding_session():
    runner = TargetRunner(tiny_engine(seed=0, slots=2), SessionTable(2), prefill_chunk=32)
    (first,) = runner.verify([VerifyCall("d", 0, [3, 4, 5], TokenTree.empty(), GREEDY)])
    prompt = VerifyCall("p", 0, LONG, TokenTree.empty(), GREEDY)
    decode = VerifyCall("d", 4, [], TokenTree.empty(), GREEDY)
    steps = [runner.verify([prompt, decode])]  # 32 of the 70 tokens, and a decode step
    steps += [runner.verify([prompt]), runner.verify([prompt])]  # 64, then 70 and the logits
    assert [s[0] is UNFINISHED for s in steps] == [True, True, False]
    assert isinstance(steps[0][1], VerifyOutcome) and isinstance(first, VerifyOutcome)
    plain = TargetRunner(tiny_engine(seed=0, slots=1), SessionTable(1))
    (whole,) = plain.verify([VerifyCall("p", 0, LONG, TokenTree.empty(), GREEDY)])
    assert steps[2][0].emitted == whole.emitted
    (session,) = [s for s in runner.table.sessions.values() if s.id == "p"]
    ours, theirs = runner.engine.cache.entries(session.slot, 70), plain.engine.cache.entries(0, 70)
    assert torch.allclose(ours[0], theirs[0], atol=1e-4)


def test_a_draft_prefills_a_long_history_in_chunks_beside_another_sessions_tree():
    spec = TreeSpec(depth=3, branching=2, budget=6)
    drafter = ModelDrafter(tiny_engine(seed=1, slots=2), SessionTable(2), prefill_chunk=32)
    prompt, other = ProposeCall("p", 0, LONG, spec), ProposeCall("o", 0, [3, 4, 5], spec)
    steps = [drafter.propose([prompt, other]), drafter.propose([prompt]), drafter.propose([prompt])]
    assert [s[0] is UNFINISHED for s in steps] == [True, True, False]
    assert len(steps[0][1]) == 6  # the other session's tree came with the first chunk
    plain = ModelDrafter(tiny_engine(seed=1, slots=1), SessionTable(1))
    (whole,) = plain.propose([ProposeCall("p", 0, LONG, spec)])
    assert steps[2][0].tokens.tolist() == whole.tokens.tolist()
    assert steps[2][0].parents.tolist() == whole.parents.tolist()
    (session,) = [s for s in drafter.table.sessions.values() if s.id == "p"]
    ours, theirs = drafter.engine.cache.entries(session.slot, 69), plain.engine.cache.entries(0, 69)
    assert torch.allclose(ours[0], theirs[0], atol=1e-4)


async def test_chunked_prefill_gives_the_unchunked_tokens_over_grpc():
    """Two sessions at once on a served target and draft that prefill 16 tokens per batch:
    each text equals the target's own unchunked greedy run."""
    prompts = [LONG, LONG[:45]]
    target, draft = tiny_engine(seed=0, slots=2), perturbed_draft(0, 0.01)
    async with (
        target_worker(target, prefill_chunk=16, batch_wait_ms=5) as (server, remote_target),
        draft_worker(draft, prefill_chunk=16, batch_wait_ms=0) as (draft_server, remote_draft),
    ):
        route = await Pair.of(remote_target, remote_draft)
        spec = TreeSpec(depth=4, branching=2, budget=8)
        gens = await asyncio.gather(*(run(route, p, 24, spec) for p in prompts))
        assert server.batcher.batches >= 70 // 16  # the long prompt took several steps
        assert draft_server.batcher.batches >= 70 // 16  # on the draft too
    for prompt, gen in zip(prompts, gens, strict=True):
        assert gen.token_ids == await target_only(0, prompt, 24)
