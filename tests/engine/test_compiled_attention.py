"""Which attention an engine gets: the compiled kernel where it builds and serves, else the
chunked torch ops ("auto"), with "compiled" refusing loudly instead of falling back.

That both give bit-identical logits however a token is batched, and both match
transformers, is tested in test_batch_invariance.py and test_native_parity.py."""

import logging
from itertools import accumulate
from types import SimpleNamespace

import pytest
import torch

from tests.engine.tiny import tiny_hf_model
from workers.engine import native
from workers.engine.batch import SlotInput, VisibleKeys
from workers.engine.engine import Engine, EngineConfig
from workers.engine.llama import rms_norm, rotate_half
from workers.engine.paged_attention import (
    SOURCE,
    CompiledAttention,
    build,
    compiled_attention,
)

CPU = torch.device("cpu")


def test_auto_compiles_once_and_caches_the_library(tmp_path):
    kernel = compiled_attention("auto", CPU, torch.float32, 64, tmp_path)
    assert isinstance(kernel, CompiledAttention)
    (built,) = (tmp_path / "kernels").glob("*.so")
    assert built == build(tmp_path)  # the cached library, whatever $CC names
    stamp = built.stat().st_mtime_ns
    assert compiled_attention("compiled", CPU, torch.bfloat16, 64, tmp_path) is not None
    assert built.stat().st_mtime_ns == stamp  # loaded from the cache, not built again


def test_a_changed_header_builds_the_library_anew(tmp_path):
    sources = tmp_path / "src"
    sources.mkdir()
    for name in ("paged_attention.c", "bf16.h", "pool.h"):
        (sources / name).write_bytes((SOURCE.parent / name).read_bytes())
    first = native.build(sources / "paged_attention.c", tmp_path)
    with (sources / "bf16.h").open("a") as header:
        header.write("/* changed */\n")
    assert native.build(sources / "paged_attention.c", tmp_path) != first


@pytest.mark.parametrize(
    ("device", "dtype", "head_dim", "why"),
    [
        (torch.device("meta"), torch.float32, 64, "runs on the CPU"),
        (CPU, torch.float16, 64, "float32 or bfloat16"),
        (CPU, torch.float32, 60, "multiple of 8"),
    ],
)
def test_what_it_cannot_serve_falls_back_or_is_refused(
    tmp_path, caplog, device, dtype, head_dim, why
):
    with caplog.at_level(logging.WARNING):
        assert compiled_attention("auto", device, dtype, head_dim, tmp_path) is None
    assert why in caplog.text
    with pytest.raises(ValueError, match=why):
        compiled_attention("compiled", device, dtype, head_dim, tmp_path)
    assert compiled_attention("chunked", CPU, torch.float32, 64, tmp_path) is None


def test_without_a_working_compiler_auto_serves_with_the_chunked_attention(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with caplog.at_level(logging.WARNING):
        kernel = compiled_attention("auto", CPU, torch.float32, 64, tmp_path)
    assert kernel is None and "did not build" in caplog.text
    with pytest.raises(ValueError, match="did not build"):
        compiled_attention("compiled", CPU, torch.float32, 64, tmp_path)
    monkeypatch.setenv("CC", "no-such-compiler")
    assert compiled_attention("auto", CPU, torch.float32, 64, tmp_path) is None
    config = EngineConfig(max_sessions=1, max_seq_len=64, cache_dir=tmp_path)
    engine = Engine.from_hf(tiny_hf_model(), None, config, "t")
    (logits,) = engine.forward([SlotInput(0, 0, [-1, 0, 1], [3, 4, 5], logits_for=3)])
    assert logits.shape == (3, 96) and engine.model.compiled is None


def test_an_unknown_choice_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not one of auto, compiled, chunked"):
        compiled_attention("fast", CPU, torch.float32, 64, tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_rotates_writes_and_attends_as_the_torch_ops_do(tmp_path, dtype):
    heads, kv_heads, dim, pool = 4, 2, 16, 12
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    angles = torch.rand(3, 1, dim, generator=gen) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)  # (N, 1, D)
    k_pool, v_pool = torch.randn(2, kv_heads, pool, dim, generator=gen).to(dtype)
    # three new tokens, written at pool positions 5, 9 and 2: a chain of two after the
    # prefix at 0, 1, 3, and a sibling of the first
    written = torch.tensor([5, 9, 2])
    seen = [[0, 1, 3, 5], [0, 1, 3, 5, 9], [0, 1, 3, 2]]
    keys = VisibleKeys(torch.tensor(sum(seen, [])), torch.tensor([0, 4, 9, 13]))
    batch = SimpleNamespace(token_positions=written, visible=keys)
    expected_k, expected_v = k_pool.clone(), v_pool.clone()

    kernel = compiled_attention("compiled", CPU, dtype, dim, tmp_path)
    out = kernel(qkv, cos, sin, k_pool, v_pool, batch)  # (N, H D)

    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(3, heads, dim), k.view(3, kv_heads, dim), v.view(3, kv_heads, dim)
    expected_k[:, written] = (k * cos + rotate_half(k) * sin).transpose(0, 1)
    expected_v[:, written] = v.transpose(0, 1)
    assert torch.equal(k_pool, expected_k) and torch.equal(v_pool, expected_v)  # bit for bit
    rotated = (q * cos + rotate_half(q) * sin).double()  # (N, H, D)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: the output's rounding
    for n, visible in enumerate(seen):
        for h in range(heads):
            own_k, own_v = (
                cache[h // (heads // kv_heads), visible].double() for cache in (k_pool, v_pool)
            )
            weights = torch.softmax(own_k @ rotated[n, h] * dim**-0.5, dim=0)  # (keys,)
            got = out[n].view(heads, dim)[h].double()
            torch.testing.assert_close(got, weights @ own_v, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [9, 1])  # 1: too few (token, key/value head) items to share
def test_threads_share_the_heads_and_change_no_bit(tmp_path, dtype, n):
    heads, kv_heads, dim, pool = 6, 2, 32, 80
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    angles = torch.rand(n, 1, dim, generator=gen) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)  # (N, 1, D)
    k_pool, v_pool = torch.randn(2, kv_heads, pool, dim, generator=gen).to(dtype)
    # a prefix at positions 0 .. 59, then a chain of n new tokens from 60 on
    seen = [list(range(61 + i)) for i in range(n)]
    keys = VisibleKeys(torch.tensor(sum(seen, [])), torch.tensor([0, *accumulate(map(len, seen))]))
    batch = SimpleNamespace(token_positions=torch.arange(60, 60 + n), visible=keys)
    library = native.load(SOURCE, tmp_path)
    outs = []
    for helpers in (0, 1, 3):
        kernel = CompiledAttention(library, dtype, native.Pool(library, helpers))
        k, v = k_pool.clone(), v_pool.clone()
        outs.append((kernel(qkv, cos, sin, k, v, batch), k, v))
    for out, k, v in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip((out, k, v), outs[0], strict=True))
    out, k, v = outs[0]  # and each head (three a key/value head) is its own attention
    q = qkv[:, : heads * dim].view(n, heads, dim)
    rotated = (q * cos + rotate_half(q) * sin).double()  # (N, H, D)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for t, visible in enumerate(seen):
        for h in range(heads):
            own_k, own_v = (cache[h // 3, visible].double() for cache in (k, v))
            weights = torch.softmax(own_k @ rotated[t, h] * dim**-0.5, dim=0)  # (keys,)
            got = out[t].view(heads, dim)[h].double()
            torch.testing.assert_close(got, weights @ own_v, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [64, 20])  # 20: a tail past the kernel's 8 lanes
def test_the_compiled_rms_norm_is_the_torch_one_and_each_row_its_own(tmp_path, dtype, width):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(5, width, generator=gen) * 3).to(dtype)
    weight = torch.rand(width, generator=gen).to(dtype) + 0.5
    kernel = compiled_attention("compiled", CPU, dtype, 64, tmp_path)
    normed = kernel.rms_norm(x, weight, 1e-5)
    # only the order of the mean's sum differs: a float32 ulp, or a bfloat16 rounding
    tolerance = 1e-6 if dtype == torch.float32 else 8e-3
    expected = rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(normed, expected, atol=tolerance, rtol=tolerance)
    assert all(
        torch.equal(kernel.rms_norm(x[i : i + 1], weight, 1e-5)[0], normed[i]) for i in range(5)
    )


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """One kernel cache for the tests below: each library is built once."""
    return tmp_path_factory.mktemp("kernels")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return torch.equal(a.view(ints), b.view(ints))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [64, 20])
def test_the_fused_residual_add_and_norm_are_torch_add_then_the_norm(kernels, dtype, width):
    gen = torch.Generator().manual_seed(2)
    x, delta = ((torch.randn(5, width, generator=gen) * 3).to(dtype) for _ in range(2))
    weight = torch.rand(width, generator=gen).to(dtype) + 0.5
    kernel = compiled_attention("compiled", CPU, dtype, 64, kernels)
    total, normed = kernel.add_rms_norm(x, delta, weight, 1e-5)
    assert same_bits(total, x + delta)
    assert same_bits(normed, kernel.rms_norm(x + delta, weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1536, 20])  # 20: a tail past the kernel's 8 lanes
def test_swiglu_is_torchs_silu_times_up_and_each_row_its_own(kernels, dtype, width):
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(9, 2 * width, generator=gen) * 4).to(dtype)
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 80.0, -80.0, 1e-30, -1e-30, 89.0, -86.0])
    kernel = compiled_attention("compiled", CPU, dtype, 64, kernels)
    out = kernel.swiglu(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    if dtype == torch.bfloat16:  # silu's float32 differs from torch's by an ulp or two at
        # most, which almost never moves a bfloat16 rounding
        assert (out.view(torch.int16) != expected.view(torch.int16)).float().mean() < 1e-3
        torch.testing.assert_close(out, expected, atol=0, rtol=8e-3)
    else:
        torch.testing.assert_close(out, expected, atol=1e-30, rtol=4e-7)
    assert all(same_bits(kernel.swiglu(gate_up[i : i + 1])[0], out[i]) for i in range(9))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: q/k/v biases
@pytest.mark.parametrize("threads", [1, 2])
def test_compiled_blocks_give_the_bits_of_the_blocks_one_by_one(kernels, kind, threads):
    hf = tiny_hf_model(kind, seed=4).to(torch.bfloat16)
    engines = [
        Engine.from_hf(hf, None, config, "tiny")
        for config in (
            EngineConfig(
                model="tiny",
                max_sessions=4,
                max_seq_len=128,
                cache_dir=kernels,
                kernel_threads=threads,
                compiled_blocks=fused,
            )  # fmt: skip
            for fused in (True, False)
        )
    ]
    if engines[0].model.compiled_blocks is None:
        pytest.skip("no bfloat16 kernel builds here")
    assert engines[1].model.compiled_blocks is None  # --no-compiled-blocks
    prompt = [(5 * i + 3) % 90 for i in range(40)]
    rounds = [
        [SlotInput(0, 0, list(range(-1, 39)), prompt), SlotInput(1, 0, [-1, 0, 1], [4, 5, 6])],
        [SlotInput(0, 40, [-1, 0, 0, 1], [7, 8, 9, 10], 4), SlotInput(1, 3, [-1], [11])],
    ]
    outputs = [[engine.run(rows) for rows in rounds] for engine in engines]
    for fused, one_by_one in zip(*outputs, strict=True):
        assert all(map(same_bits, fused.logits, one_by_one.logits))
        assert all(map(same_bits, fused.hidden, one_by_one.hidden))
