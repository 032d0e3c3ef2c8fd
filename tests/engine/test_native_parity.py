"""The native forward matches transformers' own forward, with and without the cache."""

import pytest
import torch

from tests.engine.tiny import tiny_engine, tiny_hf_model
from workers.engine.batch import SlotInput
from workers.engine.engine import Engine, EngineConfig

KINDS = ["llama", "qwen2", "llama3"]
ATTENTIONS = ["compiled", "chunked"]  # workers/engine/paged_attention.py, attention.py


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()  # (T, V)


def chain(n: int) -> list[int]:
    return [i - 1 for i in range(n)]


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_prefill_matches_transformers(kind, attention):
    hf = tiny_hf_model(kind)
    config = EngineConfig(max_sessions=2, max_seq_len=256, attention=attention)
    engine = Engine.from_hf(hf, None, config, kind)
    tokens = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    (ours,) = engine.forward([SlotInput(0, 0, chain(40), tokens, logits_for=40)])
    assert (ours - hf_logits(hf, tokens)).abs().max() < 1e-3


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_incremental_and_batched_match_transformers(kind, attention):
    hf = tiny_hf_model(kind, seed=3)
    config = EngineConfig(max_sessions=3, max_seq_len=256, attention=attention)
    engine = Engine.from_hf(hf, None, config, kind)
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (30, 17, 45)]
    # prefill all but the last 5 tokens of each, in one batched forward of uneven rows
    rows = [SlotInput(i, 0, chain(len(s) - 5), s[:-5]) for i, s in enumerate(seqs)]
    engine.forward(rows)
    # then the last 5 tokens, batched again, one slot fed as 2 + 3 over two forwards
    rows = [SlotInput(i, len(s) - 5, chain(5), s[-5:], logits_for=5) for i, s in enumerate(seqs)]
    outs = engine.forward(rows)
    for s, out in zip(seqs, outs, strict=True):
        assert (out - hf_logits(hf, s)[-5:]).abs().max() < 1e-3


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_decode_batched_with_a_prefill_matches_transformers(attention):
    """Rows of 1 and 20 new tokens share one unpadded forward; all logits stay exact."""
    hf = tiny_hf_model("llama", seed=4)
    config = EngineConfig(max_sessions=2, max_seq_len=256, attention=attention)
    engine = Engine.from_hf(hf, None, config, "t")
    gen = torch.Generator().manual_seed(3)
    first, second = (torch.randint(0, 96, (n,), generator=gen).tolist() for n in (12, 20))
    engine.forward([SlotInput(0, 0, chain(11), first[:-1])])
    decode, prefill = engine.forward(
        [SlotInput(0, 11, [-1], first[-1:]), SlotInput(1, 0, chain(20), second, logits_for=20)]
    )
    assert (decode[0] - hf_logits(hf, first)[-1]).abs().max() < 1e-3
    assert (prefill - hf_logits(hf, second)).abs().max() < 1e-3


def test_tree_rows_match_their_own_paths():
    """Each tree node's logits equal a plain forward of its root-to-node path."""
    hf = tiny_hf_model("llama", seed=5)
    engine = Engine.from_hf(hf, None, EngineConfig(max_sessions=1, max_seq_len=256), "t")
    prompt = list(range(10, 30))
    engine.forward([SlotInput(0, 0, chain(19), prompt[:-1])])
    # region: last prompt token, then a tree: 0:(root) 1,2 children of root; 3 child of 1; 4 of 3
    parents = [-1, 0, 0, 1, 3]
    tokens = [prompt[-1], 50, 51, 52, 53]
    (out,) = engine.forward([SlotInput(0, 19, parents, tokens, logits_for=5)])
    paths = {0: [], 1: [50], 2: [51], 3: [50, 52], 4: [50, 52, 53]}
    for node, path in paths.items():
        ref = hf_logits(hf, prompt + path)[-1]
        assert (out[node] - ref).abs().max() < 1e-3


def test_commit_compacts_accepted_path():
    engine = tiny_engine(seed=7, slots=1)
    prompt = list(range(5, 25))
    engine.forward([SlotInput(0, 0, chain(20), prompt)])
    # a tree of 4 nodes after the prompt; accept nodes 1 and 3 (path 1 -> 3)
    parents, tokens = [-1, -1, 0, 1], [60, 61, 62, 63]
    engine.forward([SlotInput(0, 20, parents, tokens, logits_for=4)])
    engine.commit(0, 20, [1, 3])
    # the next token after prompt + [61, 63] must match a fresh prefill
    (after,) = engine.forward([SlotInput(0, 22, [-1], [7])])
    fresh = tiny_engine(seed=7, slots=1)
    full = prompt + [61, 63, 7]
    (ref,) = fresh.forward([SlotInput(0, 0, chain(len(full)), full)])
    assert (after - ref).abs().max() < 1e-4
