"""The compiled bfloat16 linear kernel (workers/engine/bf16_linear.py): it multiplies like a
bfloat16 layer, a row's result never depends on the rows beside it (what keeps a bfloat16
forward batch-invariant, tests/engine/test_batch_invariance.py) nor on the threads that
compute it, and the engine uses it for bfloat16 on the CPU, on the threads it is given,
keeping torch's layers where it does not build.

Every way it computes is tested where the CPU runs it: the AVX512_BF16 build on the AMX
tile unit ("tiles", Intel Xeon from Sapphire Rapids on) and on vector instructions
("native" with the tile unit off), and the AVX2 build (built here with AVX512_BF16
switched off, as on CPUs without it)."""

from __future__ import annotations

import gc
import logging
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.engine.tiny import tiny_hf_model
from workers.engine import native
from workers.engine.batch import SlotInput
from workers.engine.bf16_linear import Bf16Kernel, Bf16Linear, bf16_kernel
from workers.engine.engine import Engine, EngineConfig, resolve_dtype

BUILDS = {"tiles": (), "native": (), "avx2": ("-mno-avx512bf16",)}  # the compiler's flags


def load(build: str, folder, threads: int = 1) -> Bf16Kernel:
    if build == "avx2" and "avx512_bf16" not in native.cpu_identity().split():
        pytest.skip("the native build is the AVX2 one on this CPU")
    try:
        kernel = Bf16Kernel.load(folder, threads, BUILDS[build], amx=build == "tiles")
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"the kernel does not build here: {getattr(error, 'stderr', error)}")
    if build == "tiles" and not kernel.amx:
        pytest.skip("no AMX tile unit here (or Linux does not grant it)")
    return kernel


@pytest.fixture(scope="module", params=list(BUILDS))
def kernel(request, tmp_path_factory) -> Bf16Kernel:
    return load(request.param, tmp_path_factory.mktemp("kernels"))


def weights(n: int, k: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()  # (N, K)
    b = (torch.randn(n, generator=g) * 0.1).bfloat16() if bias else None  # (N,)
    return w, b


@pytest.mark.parametrize(("n", "k"), [(64, 32), (200, 96), (37, 61), (576, 1536), (70, 20)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 13, 16, 35])
def test_it_multiplies_like_a_bfloat16_layer(kernel, n, k, bias, rows):
    w, b = weights(n, k, bias)
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(1))).bfloat16()  # (R, K)
    exact = x.double() @ w.double().T + (0 if b is None else b.double())  # (R, N)
    y = kernel.linear(x, kernel.pack(w), b, n)  # (R, N) bfloat16
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    # float32 sums of K products, rounded once to bfloat16: within one bf16 ulp (2^-8 relative)
    # of the exact value, plus float32 rounding of the sum
    slack = exact.abs() * 2**-8 + (x.double().abs() @ w.double().abs().T) * k * 2**-24
    assert ((y.double() - exact).abs() <= slack + 1e-30).all()


@pytest.mark.parametrize("rows", [2, 3, 20])
def test_an_exact_sum_is_rounded_as_torch_rounds_it(kernel, rows):
    """Small integers: every product and partial sum is exact in float32, so each output is
    the exact value (up to 12 bits, ties among them) rounded once; it must be torch's
    rounding of it to bfloat16 (to nearest, ties to even), bias and panel tails included."""
    g = torch.Generator().manual_seed(6)
    n, k = 150, 64  # 150 outputs: a panel's tail of 22
    w = torch.randint(-8, 9, (n, k), generator=g).bfloat16()  # (N, K)
    b = torch.randint(-300, 301, (n,), generator=g).bfloat16()  # (N,)
    x = torch.randint(-8, 9, (rows, k), generator=g).bfloat16()  # (R, K)
    x[0, 5] = float("nan")  # row 0: NaN everywhere
    exact = (x.double() @ w.double().T + b.double()).float()  # (R, N) exact in float32
    y = kernel.linear(x, kernel.pack(w), b, n)  # (R, N) bfloat16
    assert y[0].isnan().all()
    assert torch.equal(y[1:].view(torch.int16), exact[1:].bfloat16().view(torch.int16))
    assert (exact[1:].abs() > 256).any()  # values that had to be rounded


@pytest.mark.parametrize(("n", "k"), [(200, 96), (37, 61)])
def test_a_row_is_the_same_bits_whatever_rows_share_the_call(kernel, n, k):
    w, b = weights(n, k, bias=True)
    panels = kernel.pack(w)
    x = torch.randn(130, k, generator=torch.Generator().manual_seed(2)).bfloat16()  # (130, K)
    alone = torch.cat([kernel.linear(x[i : i + 1], panels, b, n) for i in range(20)])  # (20, N)
    for rows in (2, 3, 5, 6, 7, 12, 16, 17, 20, 32, 33, 130):
        assert torch.equal(kernel.linear(x[:rows], panels, b, n)[:20], alone[:rows])


@pytest.mark.parametrize("build", list(BUILDS))
def test_a_result_is_the_same_bits_on_any_number_of_threads(build, tmp_path):
    alone = load(build, tmp_path)
    pooled = [load(build, tmp_path, threads) for threads in (2, 3)]
    g = torch.Generator().manual_seed(3)
    for n, k in [(64, 32), (37, 61), (960, 576), (576, 1536)]:
        w, b = weights(n, k, bias=n % 2 == 1)
        panels = alone.pack(w)
        for rows in (1, 2, 5, 13, 40):  # one pass per panel, tiles of rows, widened panels
            x = torch.randn(rows, k, generator=g).bfloat16()  # (R, K)
            want = alone.linear(x, panels, b, n)
            for kernel in pooled:
                assert torch.equal(kernel.linear(x, panels, b, n), want)


def test_many_calls_in_a_row_each_wait_for_all_their_panels(tmp_path):
    kernel = load("native", tmp_path, threads=2)
    w, b = weights(600, 48, bias=True)  # 10 panels
    panels = kernel.pack(w)
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(4)).bfloat16()
    want = load("native", tmp_path).linear(x, panels, b, 600)
    for _ in range(2000):  # calls closer together than a helper spins, so it joins each
        assert torch.equal(kernel.linear(x, panels, b, 600), want)


def test_a_kernel_collected_joins_its_threads(tmp_path):
    def threads() -> int:  # the kernel's helpers in this process (other tests' threads vary)
        names = (task / "comm" for task in Path("/proc/self/task").iterdir())
        return sum(1 for name in names if name.read_text().strip() == "specsplit-pool")

    if not Path("/proc/self/task").is_dir():
        pytest.skip("no /proc here")
    before = threads()
    kernel = load("native", tmp_path, threads=3)
    assert threads() == before + 2
    del kernel
    gc.collect()
    assert threads() == before


def test_the_tile_unit_is_used_only_where_the_build_and_the_caller_want_it(tmp_path):
    """A library built without AMX, or a kernel told not to, multiplies on vector
    instructions; a CPU with AMX gets it by default; its products round as closely."""
    without = Bf16Kernel.load(tmp_path, extra_flags=("-mno-amx-tile", "-mno-amx-bf16"))
    assert not without.amx and not Bf16Kernel.load(tmp_path, amx=False).amx
    flags = native.cpu_identity().split()
    has_amx = {"amx_tile", "amx_bf16", "avx512_bf16"} <= set(flags)
    assert Bf16Kernel.load(tmp_path).amx == has_amx
    tiles = load("tiles", tmp_path)
    w, b = weights(200, 96, bias=True)
    x = torch.randn(20, 96, generator=torch.Generator().manual_seed(5)).bfloat16()  # (20, K)
    exact = x.double() @ w.double().T + b.double()  # (20, N)
    for kernel in (tiles, without):
        error = (kernel.linear(x, kernel.pack(w), b, 200).double() - exact).abs()
        assert (error <= exact.abs() * 2**-8 + 1e-3).all()


def test_rows_of_another_dtype_are_refused(kernel):
    w, _ = weights(64, 32, bias=False)
    with pytest.raises(TypeError, match="takes bfloat16 rows"):
        kernel.linear(torch.randn(2, 32), kernel.pack(w), None, 64)


def test_the_layer_keeps_leading_dimensions(kernel):
    linear = nn.Linear(48, 80, bias=True).to(torch.bfloat16)
    layer = Bf16Linear(linear, kernel)
    x = torch.randn(2, 3, 48).bfloat16()
    with torch.inference_mode():
        y = layer(x)
        assert y.shape == (2, 3, 80)
        assert torch.equal(y[1, 2], layer(x[1, 2:3])[0])
        assert torch.allclose(y.float(), linear(x).float(), atol=0.05, rtol=0.02)


def test_a_bfloat16_engine_on_the_cpu_uses_it_and_matches_torch_layers(tmp_path):
    if bf16_kernel(torch.bfloat16, torch.device("cpu"), tmp_path) is None:
        pytest.skip("the kernel does not build here")
    hf = tiny_hf_model(seed=5).to(torch.bfloat16)
    config = EngineConfig(model="tiny", max_sessions=1, max_seq_len=64, cache_dir=tmp_path)
    engines = [
        Engine.from_hf(hf, None, EngineConfig(**{**vars(config), "pack_weights": p}), "tiny")
        for p in (False, True)
    ]
    assert isinstance(engines[1].model.lm_head, Bf16Linear)
    assert engines[1].model.lm_head.kernel.threads == torch.get_num_threads()
    assert isinstance(engines[0].model.lm_head, nn.Linear)
    prompt = list(range(3, 20))
    outs = []
    for engine in engines:
        engine.forward([SlotInput(0, 0, list(range(-1, len(prompt) - 1)), prompt)])
        outs.append(engine.forward([SlotInput(0, len(prompt), [-1], [7])])[0])
    # two bfloat16 forwards rounding in different orders: close, not equal
    assert torch.allclose(outs[0], outs[1], atol=0.25, rtol=0.05)


def test_an_engine_gives_the_kernel_the_threads_it_is_told(tmp_path):
    if bf16_kernel(torch.bfloat16, torch.device("cpu"), tmp_path) is None:
        pytest.skip("the kernel does not build here")
    hf = tiny_hf_model(seed=5).to(torch.bfloat16)
    logits = []
    for threads in (1, 3):
        config = EngineConfig(
            model="tiny", max_sessions=1, max_seq_len=64, cache_dir=tmp_path, kernel_threads=threads
        )
        engine = Engine.from_hf(hf, None, config, "tiny")
        assert engine.model.lm_head.kernel.threads == threads
        assert engine.model.blocks[0].compiled.pool is engine.model.lm_head.kernel.pool
        logits.append(engine.forward([SlotInput(0, 0, [-1, 0, 1], [3, 4, 5], logits_for=3)])[0])
    assert torch.equal(logits[0], logits[1])
    config = EngineConfig(
        model="tiny", max_sessions=1, max_seq_len=64, cache_dir=tmp_path, amx=False
    )
    assert not Engine.from_hf(hf, None, config, "tiny").model.lm_head.kernel.amx


def test_without_a_working_compiler_the_engine_keeps_torch_layers(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    hf = tiny_hf_model(seed=5).to(torch.bfloat16)
    config = EngineConfig(model="tiny", max_sessions=1, max_seq_len=64, cache_dir=tmp_path)
    with caplog.at_level(logging.WARNING):
        engine = Engine.from_hf(hf, None, config, "tiny")
    assert isinstance(engine.model.lm_head, nn.Linear)
    assert "kernel did not build" in caplog.text
    logits = engine.forward([SlotInput(0, 0, [-1, 0], [3, 4], logits_for=2)])[0]
    assert logits.shape == (2, 96)


def test_auto_dtype_is_bfloat16_on_a_cpu_where_the_kernel_builds_else_float32(
    tmp_path, monkeypatch
):
    builds = bf16_kernel(torch.bfloat16, torch.device("cpu"), tmp_path) is not None
    assert resolve_dtype("auto", "cpu", tmp_path) == ("bfloat16" if builds else "float32")
    assert resolve_dtype("float32", "cpu", tmp_path) == "float32"  # a named dtype stays
    assert resolve_dtype("bfloat16", "cpu", tmp_path) == "bfloat16"
    monkeypatch.setenv("CC", "false")  # no compiler: torch's bfloat16 would be emulated
    assert resolve_dtype("auto", "cpu", tmp_path / "other") == "float32"
