"""A token's logits are bit-identical however it reaches the model: in a prefill, one token
at a time, as a tree node, or batched with other sessions' rows of other lengths; with the
compiled attention (workers/engine/paged_attention.py) and the chunked one
(workers/engine/attention.py) alike.

This is what makes speculative greedy equal the same engine's target-only greedy in
bfloat16, where a one-ulp difference flips near-ties (tests/gateway/test_bf16.py).
"""

import pytest
import torch

from tests.engine.tiny import engine_device, tiny_hf_model
from workers.engine.attention import MIN_ROWS, scores_by_chunk
from workers.engine.batch import SlotInput
from workers.engine.engine import Engine, EngineConfig

DTYPES = [torch.float32, torch.bfloat16]
ATTENTIONS = ["compiled", "chunked"]
CASES = [(d, a) for d in DTYPES for a in ATTENTIONS]
SEQ = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(11)).tolist()
OTHER = torch.randint(0, 96, (23,), generator=torch.Generator().manual_seed(12)).tolist()
LONG = torch.randint(0, 96, (100,), generator=torch.Generator().manual_seed(13)).tolist()


def chain(n: int) -> list[int]:
    return [i - 1 for i in range(n)]


def engine(dtype: torch.dtype, attention: str) -> Engine:
    """The chunked attention on $SPECSPLIT_TEST_DEVICE (tests/engine/tiny.py), the compiled
    one on the CPU it runs on."""
    device = engine_device() if attention == "chunked" else "cpu"
    hf = tiny_hf_model("llama", seed=9).to(dtype).to(device)
    config = EngineConfig(device=device, max_sessions=3, max_seq_len=256, attention=attention)
    return Engine.from_hf(hf, None, config, "t")


def one_by_one(eng: Engine, slot: int, tokens: list[int]) -> torch.Tensor:
    """Logits of every position, the tokens fed one forward each: (len, V)."""
    return torch.cat(
        [eng.forward([SlotInput(slot, i, [-1], [x])])[0] for i, x in enumerate(tokens)]
    )


@pytest.fixture(scope="module", params=CASES, ids=str)
def reference(request):
    eng = engine(*request.param)
    return request.param, one_by_one(eng, 0, SEQ)


def test_prefill_equals_one_by_one(reference):
    case, ref = reference
    eng = engine(*case)
    (whole,) = eng.forward([SlotInput(0, 0, chain(len(SEQ)), SEQ, logits_for=len(SEQ))])
    assert torch.equal(whole, ref)
    # the same prompt in uneven chunks, across block boundaries
    parts, start = [], 0
    for size in (7, 20, 13):
        piece = SEQ[start : start + size]
        parts += eng.forward([SlotInput(1, start, chain(size), piece, logits_for=size)])
        start += size
    assert torch.equal(torch.cat(parts), ref)


@pytest.mark.parametrize("prefix", [5, 20, 32])  # within, across, at a block boundary
def test_tree_nodes_equal_one_by_one(reference, prefix):
    case, ref = reference
    eng = engine(*case)
    eng.forward([SlotInput(0, 0, chain(prefix), SEQ[:prefix])])
    # the true path (regions 0, 2, 4, 6, 7) interleaved with decoys, so a node's ancestors
    # sit in scattered columns
    parents = [-1, 0, 0, 1, 2, 3, 4, 6, 5]
    true = SEQ[prefix : prefix + 5]
    tokens = [true[0], 90, true[1], 91, true[2], 92, true[3], true[4], 93]
    (out,) = eng.forward([SlotInput(0, prefix, parents, tokens, logits_for=len(tokens))])
    path = [0, 2, 4, 6, 7]
    assert torch.equal(out[path], ref[prefix : prefix + 5])


def test_batched_with_other_sessions_equals_alone(reference):
    case, ref = reference
    eng = engine(*case)
    eng.forward([SlotInput(0, 0, chain(30), SEQ[:30])])
    eng.forward([SlotInput(1, 0, chain(5), OTHER[:5])])
    # a decode beside another session's decode (another width) and a prefill (another group)
    decode, _, _ = eng.forward(
        [
            SlotInput(0, 30, [-1], SEQ[30:31]),
            SlotInput(1, 5, [-1], OTHER[5:6]),
            SlotInput(2, 0, chain(17), OTHER[:17]),
        ]
    )
    assert torch.equal(decode, ref[30:31])
    # a tree beside another slot's tree of as many nodes (one gathered attention call)
    parents = [-1, 0, 0, 2]
    tree, _ = eng.forward(
        [
            SlotInput(0, 31, parents, [SEQ[31], 95, SEQ[32], SEQ[33]], logits_for=4),
            SlotInput(1, 6, parents, OTHER[6:10], logits_for=4),
        ]
    )
    assert torch.equal(tree[[0, 2, 3]], ref[31:34])


@pytest.mark.parametrize("case", CASES, ids=str)
def test_tree_beside_a_tree_behind_a_longer_prefix_equals_one_by_one(case):
    """Two trees of as many nodes share one attention call, whose shared columns are the
    longer prefix's whole blocks: the shorter prefix's tree nodes read zero chunks there
    before their own, and still sum exactly as one token at a time does."""
    ref = one_by_one(engine(*case), 0, LONG)
    eng = engine(*case)
    short, long = 50, 70  # 3 and 4 whole blocks of 16
    eng.forward([SlotInput(0, 0, chain(short), LONG[:short])])
    eng.forward([SlotInput(1, 0, chain(long), LONG[:long])])
    parents = [-1, 0, 0] + list(range(2, 17))  # a decoy beside the true path's second node
    path = [0, *range(2, 18)]

    def tree(slot: int, prefix: int) -> SlotInput:
        true = LONG[prefix : prefix + 17]
        return SlotInput(slot, prefix, parents, [true[0], 95, *true[1:]], logits_for=18)

    out_short, out_long = eng.forward([tree(0, short), tree(1, long)])
    assert torch.equal(out_short[path], ref[short : short + 17])
    assert torch.equal(out_long[path], ref[long : long + 17])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [MIN_ROWS, 8, 52])
def test_a_score_does_not_depend_on_how_many_keys_its_product_reads(rows, threads):
    """The attention computes a query's scores in one product with all its keys. That is
    batch-invariant because an entry of a float32 product of at least MIN_ROWS rows is the
    same whatever the product's width (torch 2.13 CPU): checked here against the chunk-wide
    products the weighted values use."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(5)
        q = torch.randn(2, 3, rows, 64, generator=g)  # (K, Hkv, R, D)
        keys = torch.randn(2, 3, 1040, 64, generator=g)  # (K, Hkv, L, D)
        whole = scores_by_chunk(q, keys, 16)  # (K, Hkv, 65, R, 16)
        for width in (16, 48, 144, 512):
            part = scores_by_chunk(q, keys[:, :, :width].contiguous(), 16)
            assert torch.equal(part, whole[:, :, : width // 16])
        by_chunk = torch.matmul(q.unsqueeze(2), keys.view(2, 3, 65, 16, 64).transpose(-1, -2))
        assert torch.equal(whole, by_chunk)
    finally:
        torch.set_num_threads(before)
