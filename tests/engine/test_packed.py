"""oneDNN-packed and row-tiled linear layers give the plain layers' results, each row's
the same bits whatever rows share the call."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.engine.tiny import tiny_hf_model
from workers.engine.batch import SlotInput
from workers.engine.engine import Engine, EngineConfig
from workers.engine.packed import TILE_ROWS, PackedLinear, TiledLinear, can_pack, pack_linears

needs_packing = pytest.mark.skipif(
    not can_pack(torch.float32, torch.device("cpu")), reason="no oneDNN linear ops"
)


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 32), (5, 32), (2, 7, 32), (3, 1, 32)])
def test_packed_linear_equals_linear(bias, shape):
    torch.manual_seed(0)
    linear = nn.Linear(32, 48, bias=bias)
    x = torch.randn(shape)
    with torch.inference_mode():
        assert torch.allclose(PackedLinear(linear)(x), linear(x), atol=1e-5)


@needs_packing
def test_packed_rows_do_not_depend_on_the_rows_beside_them():
    # what keeps the float32 forward batch-invariant (tests/engine/test_batch_invariance.py)
    torch.manual_seed(0)
    packed = PackedLinear(nn.Linear(96, 160, bias=True))
    x = torch.randn(130, 96)
    with torch.inference_mode():
        alone = torch.cat([packed(x[i : i + 1]) for i in range(17)])  # (17, 160)
        for rows in (2, 5, 17, 130):
            assert torch.equal(packed(x[:rows])[:17], alone[:rows])


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_rows_equal_the_linear_and_do_not_depend_on_the_rows_beside_them(device, dtype):
    """What keeps a GPU forward batch-invariant: products of TILE_ROWS rows, padded."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=True).to(device, dtype)
    tiled = TiledLinear(linear)
    x = torch.randn(130, 96, device=device, dtype=dtype)
    with torch.inference_mode():
        alone = torch.cat([tiled(x[i : i + 1]) for i in range(TILE_ROWS + 1)])
        for rows in (2, 5, TILE_ROWS, TILE_ROWS + 1, 130):
            assert torch.equal(tiled(x[:rows])[: TILE_ROWS + 1], alone[:rows])
        torch.testing.assert_close(tiled(x.view(2, 65, 96)), linear(x).view(2, 65, 160))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_model_on_a_gpu_gets_tiled_layers():
    model = nn.Module()
    model.lm_head = nn.Linear(4, 4).cuda()
    model.blocks = []
    assert pack_linears(model, None) and isinstance(model.lm_head, TiledLinear)


def test_only_float32_on_cpu_is_onednn_packed_and_float16_is_left_alone(tmp_path):
    # bfloat16 on the CPU has its own kernel (tests/engine/test_bf16_linear.py)
    assert not can_pack(torch.bfloat16, torch.device("cpu"))
    model = nn.Module()
    model.lm_head = nn.Linear(4, 4).to(torch.float16)
    model.blocks = []
    assert not pack_linears(model, None)


@needs_packing
def test_packed_engine_matches_the_plain_one():
    hf = tiny_hf_model(seed=5)
    config = EngineConfig(model="tiny", max_sessions=1, max_seq_len=64)
    engines = [
        Engine.from_hf(hf, None, EngineConfig(**{**vars(config), "pack_weights": p}), "tiny")
        for p in (False, True)
    ]
    assert isinstance(engines[1].model.lm_head, PackedLinear)
    prompt = list(range(3, 20))
    tree = SlotInput(0, len(prompt), [-1, 0, 0, 1], [7, 8, 9, 10], logits_for=4)
    outs = []
    for engine in engines:
        engine.forward([SlotInput(0, 0, list(range(-1, len(prompt) - 1)), prompt)])
        outs.append(engine.forward([tree])[0])
    assert torch.allclose(outs[0], outs[1], atol=1e-4)
    assert torch.equal(outs[0].argmax(-1), outs[1].argmax(-1))


@pytest.mark.parametrize("pack", [False, True])
def test_a_prompt_token_costs_the_blocks_share_of_a_token_packed_or_not(pack):
    # what a worker counts a prompt token as in the tokens its steps report (the gateway's
    # cost fit): the decoder layers' matrix weights over theirs and the LM head's
    hf = tiny_hf_model(seed=5)
    config = EngineConfig(model="tiny", max_sessions=1, max_seq_len=64, pack_weights=pack)
    engine = Engine.from_hf(hf, None, config, "tiny")
    linears = [m for m in hf.model.layers.modules() if isinstance(m, nn.Linear)]
    blocks = sum(m.weight.numel() for m in linears)  # q, k, v, o, gate, up, down
    head = hf.lm_head.weight.numel()
    assert engine.model.prompt_token_share == pytest.approx(blocks / (blocks + head))
    assert 0.5 < engine.model.prompt_token_share < 1.0
