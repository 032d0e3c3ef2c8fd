"""`specsplit bench gpu`: the native engine on a CUDA GPU, eager and CUDA graphs, beside
transformers `generate`, on a random-weight 1B-class Llama (no files, no hub).

For each of `--dtypes`, on one prompt of random tokens, greedy, one stream:
  - transformers `generate` (its default cache and attention),
  - SpecSplit's loop over the native engine, target only, every kernel launched
    from Python (`--no-cuda-graphs`),
  - the same with decode forwards replayed as CUDA graphs (the default on a GPU),
and prints tokens/s, the ratio to transformers `generate`, and how many leading
tokens each row shares with transformers and with the eager engine. Then the cost of
one forward (bench/forward.py's shapes) eager and graphed, and tokens/s of the engine
served as a target worker over gRPC at `--sessions` concurrent sessions (bench/workers.py's
loop: batched decode steps). bench/GPU.md holds a run.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

import torch
from pydantic import Field
from pydantic_settings import BaseSettings

from workers.engine.engine import Engine, EngineConfig
from workers.engine.sessions import SessionTable
from workers.loop import Plan
from workers.loop.inprocess import LocalDecoder
from workers.settings import parse, settings_config
from workers.speculation.sampling import SamplingParams
from workers.target.runner import TargetRunner
from workers.tools.bench.forward import forward_costs
from workers.tools.bench.machine import describe
from workers.tools.bench.report import publish
from workers.tools.bench.workers import served_rows


class GpuBenchSettings(BaseSettings):
    model_config = settings_config("bench gpu")

    layers: int = Field(16, ge=1, description="decoder layers (16: Llama 3.2 1B's shape)")
    dtypes: str = Field("bfloat16,float32", description="comma list: dtypes to run")
    prompt_tokens: int = Field(128, ge=1, description="random prompt tokens")
    max_tokens: int = Field(128, ge=1, description="new tokens per generation")
    repeats: int = Field(3, ge=1, description="timed generations per row (median)")
    sessions: list[int] = Field(
        [1, 8], description="concurrent sessions over gRPC, a target worker, no draft"
    )
    device: str = Field("cuda", description="torch device")
    out: Path = Field(Path("bench/results"), description="where the Markdown table goes")


def llama_1b(layers: int):
    """Llama 3.2 1B's shape (1.24 B parameters at 16 layers), random weights."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=True,
    )


def timed(run, repeats: int) -> tuple[float, list[int]]:
    """Median seconds of `run()` over `repeats` runs after one warm-up, and its tokens."""
    out = run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def served_rates(engine: Engine, s: GpuBenchSettings, streaming: bool = True) -> list[float]:
    """Tokens/s of a target worker on `engine` over gRPC, no draft, greedy, for each of
    `--sessions` concurrent sessions of random prompts (bench/workers.py); each count runs
    twice and the second is timed (the first captures its layouts' graphs). `streaming`
    False: each round a unary call, not a message of the worker's stream."""
    gen = torch.Generator().manual_seed(1)
    plans = [
        Plan(
            torch.randint(0, engine.vocab_size, (s.prompt_tokens,), generator=gen).tolist(),
            s.max_tokens,
            SamplingParams(),
        )
        for _ in range(max(s.sessions))
    ]
    counts = s.sessions + s.sessions
    rows = asyncio.run(
        served_rows(engine, plans, counts, draft=False, batch_wait_ms=2.0, streaming=streaming)
    )
    return [r.tokens / r.seconds for r in rows[len(s.sessions) :]]


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def dtype_rows(
    s: GpuBenchSettings, dtype: torch.dtype
) -> tuple[list[str], dict[str, dict], dict[str, list[float]]]:
    """The generation rows' table lines, and each engine's forward costs and served
    tokens/s, for one dtype."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(s.device):
        hf = AutoModelForCausalLM.from_config(llama_1b(s.layers), dtype=dtype).eval()
    prompt = torch.randint(0, hf.config.vocab_size, (s.prompt_tokens,)).tolist()
    n = s.max_tokens

    def hf_generate() -> list[int]:
        ids = torch.tensor([prompt], device=s.device)
        with torch.inference_mode():
            out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return out[0, len(prompt) :].tolist()

    rows = {"transformers generate": timed(hf_generate, s.repeats)}
    costs, served = {}, {}
    slots = max(8, *s.sessions)
    for graphs in (False, True):
        config = EngineConfig(
            "llama-1b-random", device=s.device, max_sessions=slots, max_seq_len=1024,
            cuda_graphs=graphs,
        )  # fmt: skip
        name = "SpecSplit, CUDA graphs" if graphs else "SpecSplit, eager"
        engine = Engine.from_hf(hf, None, config, "llama-1b-random")
        decoder = LocalDecoder(TargetRunner(engine, SessionTable(slots)))
        rows[name] = timed(
            lambda d=decoder: d.generate(prompt, n, SamplingParams()).token_ids, s.repeats
        )
        costs[name] = forward_costs(engine)
        del engine, decoder
        engine = Engine.from_hf(hf, None, config, "llama-1b-random")  # its slots all free
        served[name] = served_rates(engine, s)
        if graphs:  # the stream's gain where a round is short
            del engine
            engine = Engine.from_hf(hf, None, config, "llama-1b-random")
            served[name + ", Verify as calls"] = served_rates(engine, s, streaming=False)
        del engine
        torch.cuda.empty_cache()
    base, reference = rows["transformers generate"]
    eager = rows["SpecSplit, eager"][1]
    lines = []
    for name, (seconds, tokens) in rows.items():
        lines.append(
            f"| {str(dtype).removeprefix('torch.')} | {name} | {n / seconds:.1f} | "
            f"{base / seconds:.2f} | {shared_prefix(tokens, reference)} / {n} | "
            f"{shared_prefix(tokens, eager)} / {n} |"
        )
    return lines, costs, served


def run_gpu_bench(s: GpuBenchSettings) -> str:
    generation = [
        f"GPU benchmark: a random-weight Llama of Llama 3.2 1B's shape ({s.layers} layers), "
        f"one prompt of {s.prompt_tokens} random tokens, {s.max_tokens} new tokens, greedy, "
        f"one stream, median of {s.repeats}. Machine: {describe()}.",
        "",
        "| dtype | decoder | tokens/s | × transformers generate | leading tokens as "
        "transformers | as SpecSplit eager |",
        "|---|---|---:|---:|---:|---:|",
    ]
    counts = " | ".join(f"{n} session{'s' if n > 1 else ''}" for n in s.sessions)
    serving = [
        "",
        f"Served over gRPC (a target worker in this process, no draft, {s.max_tokens} new "
        f"tokens a session, random {s.prompt_tokens}-token prompts), tokens/s:",
        "",
        f"| dtype | engine | {counts} |",
        "|---|---|" + "---:|" * len(s.sessions),
    ]
    forwards = []  # (dtype, engine, {shape: ms})
    for name in [d.strip() for d in s.dtypes.split(",") if d.strip()]:
        lines, costs, served = dtype_rows(s, getattr(torch, name))
        generation += lines
        forwards += [(name, engine, ms) for engine, ms in costs.items()]
        for engine, rates in served.items():
            serving.append(f"| {name} | {engine} | " + " | ".join(f"{r:.1f}" for r in rates) + " |")
    shapes = list(forwards[0][2])
    forward_lines = [
        "",
        "One forward, median ms (bench/forward.py's shapes, behind a 130-token prefix):",
        "",
        "| dtype | engine | " + " | ".join(shapes) + " |",
        "|---|---|" + "---:|" * len(shapes),
    ]
    forward_lines += [
        f"| {name} | {engine} | " + " | ".join(f"{ms[k]:.2f}" for k in shapes) + " |"
        for name, engine, ms in forwards
    ]
    return "\n".join(generation + forward_lines + serving)


def main(argv: list[str]) -> None:
    s = parse(GpuBenchSettings, argv)
    table = run_gpu_bench(s)
    publish(table, s.out, "gpu.md")
