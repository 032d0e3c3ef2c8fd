"""Which attention an engine gets: the compiled kernel where it builds and serves, else the
chunked torch ops ("auto"), with "compiled" refusing loudly instead of falling back.

That both give bit-identical logits however a token is batched, and both match
transformers, is tested in test_batch_invariance.py and test_native_parity.py."""

import logging

import pytest
import torch

from tests.engine.tiny import tiny_hf_model
from workers.engine.batch import SlotInput
from workers.engine.engine import Engine, EngineConfig
from workers.engine.paged_attention import CompiledAttention, build, compiled_attention

CPU = torch.device("cpu")


def test_auto_compiles_once_and_caches_the_library(tmp_path):
    kernel = compiled_attention("auto", CPU, torch.float32, 64, tmp_path)
    assert isinstance(kernel, CompiledAttention)
    (built,) = (tmp_path / "kernels").glob("*.so")
    assert built == build(tmp_path)  # the cached library, whatever $CC names
    stamp = built.stat().st_mtime_ns
    assert compiled_attention("compiled", CPU, torch.bfloat16, 64, tmp_path) is not None
    assert built.stat().st_mtime_ns == stamp  # loaded from the cache, not built again


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
