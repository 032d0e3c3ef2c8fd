"""`specsplit bench engine`: side-by-side decoding speed on one model, in one run.

Runs, on the same prompts and the same machine:
  - transformers `generate` greedy (target only),
  - transformers prompt-lookup `generate` (`prompt_lookup_num_tokens`),
  - SpecSplit's native engine, target only (speculation off),
  - SpecSplit with the n-gram draft as a chain and as a tree,
and prints tokens/s, the ratio to transformers `generate`, and the mean
number of tokens each target forward produced. Greedy outputs are checked to
be identical across all SpecSplit rows and transformers.

Then, for each of `--dtypes` and `--attentions`, the cost of one native
forward for the shapes a serving round feeds (bench/forward.py): 1 token, a
17-token tree, 8 sessions x 1 token, a 130-token prefill.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from pydantic import Field
from pydantic_settings import BaseSettings

from workers.draft.ngram import NgramDrafter
from workers.engine.engine import Engine, EngineConfig
from workers.engine.sessions import SessionTable
from workers.engine.text import encode_chat, stop_token_ids
from workers.loop.inprocess import LocalDecoder
from workers.protocol import TreeSpec
from workers.settings import EMBEDDED_MODEL, parse, settings_config
from workers.speculation.sampling import SamplingParams
from workers.target.runner import TargetRunner
from workers.tools.bench.forward import forward_costs
from workers.tools.bench.machine import describe
from workers.tools.bench.report import publish
from workers.tools.bench.workloads import TEXTS


def grounded_prompts() -> list[str]:
    """Input-grounded tasks: the answer mostly copies text given in the prompt."""
    return [f"Repeat this text exactly, but replace the word 'the' with 'a':\n\n{t}" for t in TEXTS]


class EngineBenchSettings(BaseSettings):
    model_config = settings_config("bench engine")

    target_model: str = Field(EMBEDDED_MODEL, description="the model to benchmark")
    max_tokens: int = Field(96, ge=1, description="new tokens per prompt")
    prompts: int = Field(3, ge=1, le=len(TEXTS), description="how many prompts to run")
    dtypes: str = Field("float32,bfloat16", description="comma list: dtypes of the forward costs")
    attentions: str = Field(
        "compiled,chunked", description="comma list: attentions of the forward costs"
    )
    threads: int = Field(0, ge=0, description="torch threads; 0 = torch's default")
    out: Path = Field(Path("bench/results"), description="where the Markdown table goes")


def run_engine_bench(s: EngineBenchSettings) -> str:
    from transformers import AutoModelForCausalLM

    from workers.engine.loader import load_tokenizer, resolve_model

    path = resolve_model(s.target_model)
    tokenizer = load_tokenizer(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = Engine.from_hf(hf, tokenizer, EngineConfig(max_sessions=2), s.target_model)
    stops = stop_token_ids(tokenizer)
    prompts = [
        encode_chat(tokenizer, [{"role": "user", "content": p}])
        for p in grounded_prompts()[: s.prompts]
    ]

    def hf_generate(**kwargs):
        def run(ids):
            with torch.inference_mode():
                out = hf.generate(
                    torch.tensor([ids]), max_new_tokens=s.max_tokens, do_sample=False, **kwargs
                )
            return out[0, len(ids) :].tolist(), None

        return run

    def spec(drafter, tree: TreeSpec):
        decoder = LocalDecoder(TargetRunner(engine, SessionTable(2)), drafter, tree, stops)

        def run(ids):
            gen = decoder.generate(ids, s.max_tokens, SamplingParams())
            return gen.token_ids, gen.stats

        return run

    rows = {
        "transformers generate (greedy)": hf_generate(),
        "transformers prompt lookup (10)": hf_generate(prompt_lookup_num_tokens=10),
        "SpecSplit native, speculation off": spec(None, TreeSpec()),
        "SpecSplit n-gram chain (depth 8)": spec(
            NgramDrafter(SessionTable(4)), TreeSpec(depth=8, branching=1, budget=8)
        ),
        "SpecSplit n-gram tree (depth 8, 24 nodes)": spec(
            NgramDrafter(SessionTable(4)), TreeSpec(depth=8, budget=24)
        ),
    }
    results = {}
    reference: list[list[int]] | None = None
    for name, run in rows.items():
        run(prompts[0][:32])  # warm-up
        outputs, tokens, steps, emitted = [], 0, 0, 0
        start = time.perf_counter()
        for ids in prompts:
            out, stats = run(ids)
            out = out[: next((i + 1 for i, t in enumerate(out) if t in stops), len(out))]
            outputs.append(out)
            tokens += len(out)
            if stats is not None:
                steps += stats.verify_steps
                emitted += stats.emitted_tokens
        elapsed = time.perf_counter() - start
        reference = reference or outputs
        same = "yes" if outputs == reference else "NO"
        tau = f"{emitted / steps:.2f}" if steps else "-"
        results[name] = (tokens / elapsed, tau, same)
    base = results["transformers generate (greedy)"][0]
    lines = [
        f"Engine benchmark: {s.target_model}, {s.prompts} input-grounded prompts, "
        f"{s.max_tokens} new tokens each, greedy. Machine: {describe()}.",
        "",
        "| decoder | tokens/s | × transformers generate | tokens per target forward | "
        "same tokens |",
        "|---|---:|---:|---:|:---:|",
    ]
    for name, (tps, tau, same) in results.items():
        lines.append(f"| {name} | {tps:.1f} | {tps / base:.2f} | {tau} | {same} |")
    return "\n".join(lines)


def forward_table(s: EngineBenchSettings) -> str:
    """Milliseconds of one native forward per shape, dtype and attention; an engine on the
    bfloat16 kernel runs it as a worker does (the kernel on every thread, torch on one)."""
    costs = {}
    threads = torch.get_num_threads()
    for dtype in [d.strip() for d in s.dtypes.split(",") if d.strip()]:
        for attention in [a.strip() for a in s.attentions.split(",") if a.strip()]:
            config = EngineConfig(s.target_model, dtype=dtype, max_sessions=8, attention=attention)
            engine = Engine.load(config)
            engine.torch_beside_kernel()
            try:
                costs[dtype, attention] = forward_costs(engine)
            finally:
                torch.set_num_threads(threads)
    shapes = list(next(iter(costs.values())))
    lines = [
        f"One native forward, median ms ({threads} torch threads; on the bfloat16 kernel, "
        f"the kernel on {threads} and torch on one, as in a worker):",
        "",
        "| dtype | attention | " + " | ".join(shapes) + " |",
        "|---|---|" + "---:|" * len(shapes),
    ]
    for (dtype, attention), ms in costs.items():
        cells = " | ".join(f"{ms[k]:.1f}" for k in shapes)
        lines.append(f"| {dtype} | {attention} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    s = parse(EngineBenchSettings, argv)
    if s.threads:
        torch.set_num_threads(s.threads)
    table = run_engine_bench(s) + "\n\n" + forward_table(s)
    publish(table, s.out, "engine.md")
