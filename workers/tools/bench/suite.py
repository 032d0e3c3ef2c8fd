"""`specsplit bench [serve]`: SpecSplit against its peers, side by side, in one run.

Rows (pick with --rows):
  hf-generate           transformers `generate`, greedy, target only (in-process)
  hf-assisted           transformers assisted generation, `assistant_model=` the model draft
  hf-prompt-lookup      transformers prompt lookup, `prompt_lookup_num_tokens=10`
  off                   SpecSplit over HTTP + gRPC, speculation off (draft none)
  off-no-prefix-cache   the same with the workers' prefix caching off
  ngram-chain           n-gram draft, a chain (branching 1), fixed size
  ngram-tree            n-gram draft, a tree with the chain's node budget, fixed size
  ngram-tree-adaptive   the same tree, adaptive (the default configuration)
  ngram-tree-adaptive-min2  the default drafting after two-token matches or longer
                        (--ngram-min-match 2)
  model-chain           model draft, a chain, fixed size
  model-tree            model draft, a tree, fixed size
  model-tree-adaptive   model draft, adaptive tree
  model-tree-overlap    model draft, adaptive tree, overlapped loop
  hybrid                model draft merged with the n-gram draft each round (--hybrid-draft),
                        adaptive, the n-gram rows' depth and budget, the model rows' branching
  ROW-bf16              any SpecSplit row above with its workers in bfloat16 (--dtype
                        bfloat16), e.g. off-bf16, ngram-tree-adaptive-bf16, hybrid-bf16;
                        their texts are checked against the first bfloat16 row's, every
                        other row's against hf-generate's (or the first float32 row's)
  ROW-bf16-cores        the same with the kernel on every core (--kernel-threads), the rest
                        of the workers on --worker-threads
  ROW-bf16-cores-noamx  the same with the kernel off the AMX tile unit (--no-amx): on a CPU
                        with one, what its vector instructions give (elsewhere the same);
                        their texts are checked against the first such row's (the two
                        round differently)
  ROW-bf16-cores-noblocks  the bfloat16 rows with the kernel on every core and the decoder
                        blocks op by op from Python (--no-compiled-blocks): the same bits,
                        so their texts are checked against the first bfloat16 row's
  ROW-bf16-cores-calls  the same with the gateway's Verify calls as unary calls, not
                        messages of one stream (--no-worker-streams): the same bits

Every SpecSplit row starts a `specsplit serve` of its own for each point it
measures (a workload at some streams), so that no point finds another's
prompts in the workers' prefix caches; a warm-up request outside the
workload, with its system prompt (`workloads.warm_up`), goes first, leaving
that system prompt cached as any earlier request of a deployment would. It
sends streaming chat completions with httpx. Workloads (workloads.py):
`grounded` (rewrite/edit/summarise a text in the prompt), `humaneval` (the
first --humaneval problems), `chat` and `shared-system` (chat after one long
system prompt). One stream runs each workload's prompts one after the other;
the sweep runs the --sweep-rows at each of --streams concurrent streams on
--sweep-workload, the streams taking the prompts from one queue
(`serving.run_streams`), each stream sending at least
--min-requests-per-stream of them. At each point the rows take turns, --repeats times (a
fresh serve each time), and the serve with the median tok/s stands for its
row: a slow minute of the machine then falls on every row alike. The report
also sets each turn's serve against speculation off's of the same turn: the
spread of those ratios is the machine's noise at that point.
Greedy everywhere, and every row's text is checked against
`hf-generate`'s (or, without it, the first row's).

Writes bench/results/bench.csv, bench.md and bench.png.
"""

from __future__ import annotations

import asyncio
import gc
import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from pydantic import Field
from pydantic_settings import BaseSettings

from workers.settings import EMBEDDED_MODEL, settings_config
from workers.tools.bench import report
from workers.tools.bench.machine import describe, load_average
from workers.tools.bench.measure import Figures, Timed, histogram_quantile
from workers.tools.bench.serving import (
    Serve,
    ServeConfig,
    bucket_delta,
    draft_model_dir,
    phase_buckets,
    run_streams,
)
from workers.tools.bench.workloads import messages, warm_up

HF_ROWS = ("hf-generate", "hf-assisted", "hf-prompt-lookup")


class BenchSettings(BaseSettings):
    model_config = settings_config("bench serve")

    target_model: str = Field(EMBEDDED_MODEL, description="the target model")
    draft_model: str = Field(
        "auto",
        description="the model draft; auto = smollm2-135m-draft when installed, "
        "else the target's first 8 layers",
    )
    rows: str = Field("all", description="comma list of rows (see the module doc), or all")
    workloads: str = Field(
        "grounded,humaneval", description="comma list: grounded, humaneval, chat"
    )
    prompts: int = Field(8, ge=1, description="input-grounded prompts")
    humaneval: int = Field(4, ge=1, le=164, description="HumanEval problems (the first N)")
    max_tokens: int = Field(96, ge=1, description="most new tokens per request")
    streams: str = Field("1,4,8,16", description="concurrency sweep: streams per point")
    min_requests_per_stream: int = Field(
        1,
        ge=1,
        description="each stream of a point sends the workload's prompts once between the "
        "streams (ceil(prompts / streams) requests) and at least this many: above 1 most "
        "of a point runs with every stream busy (a steady load, as `benchmark_serving` "
        "with many more prompts than --max-concurrency) instead of one wave ending on its "
        "slowest requests",
    )
    sweep_rows: str = Field(
        "off,ngram-tree,ngram-tree-adaptive", description="rows swept over --streams"
    )
    sweep_workload: str = Field("grounded", description="the workload swept over --streams")
    ngram_depth: int = Field(6, ge=1, description="n-gram tree depth (serve's default)")
    ngram_budget: int = Field(16, ge=1, description="n-gram tree nodes (the chain's depth too)")
    model_depth: int = Field(4, ge=1, description="model-draft tree depth")
    model_branching: int = Field(4, ge=2, description="model-draft tree: children per node")
    model_budget: int = Field(8, ge=1, description="model-draft tree nodes (the chain's depth)")
    worker_threads: int = Field(
        1,
        ge=0,
        description="torch threads of each serve worker (OMP_NUM_THREADS); 0 = torch's "
        "default. 1 leaves the second core of a 2-core machine to the gateway and client",
    )
    knee_tokens: float = Field(32.0, ge=0, description="--adaptive-knee-tokens of the serves")
    repeats: int = Field(
        1,
        ge=1,
        description="serves per SpecSplit row and point, the rows taking turns at each point; "
        "the serve with the median tok/s stands for its row there",
    )
    out: Path = Field(Path("bench/results"), description="where CSV, Markdown and PNG go")

    def names(self, value: str) -> list[str]:
        return [x.strip() for x in value.split(",") if x.strip()]


def serve_configs(s: BenchSettings) -> dict[str, ServeConfig]:
    nd, nb = s.ngram_depth, s.ngram_budget
    md, mk, mb = s.model_depth, s.model_branching, s.model_budget
    cores = len(os.sched_getaffinity(0))
    base = [
        ServeConfig("off", "none"),
        ServeConfig("off-no-prefix-cache", "none", prefix_caching=False),
        ServeConfig("ngram-chain", "ngram", nb, 1, nb),
        ServeConfig("ngram-tree", "ngram", nd, 2, nb),
        ServeConfig("ngram-tree-adaptive", "ngram", nd, 2, nb, adaptive=True),
        ServeConfig("ngram-tree-adaptive-min2", "ngram", nd, 2, nb, adaptive=True, min_match=2),
        ServeConfig("model-chain", "model", mb, 1, mb),
        ServeConfig("model-tree", "model", md, mk, mb),
        ServeConfig("model-tree-adaptive", "model", md, mk, mb, adaptive=True),
        ServeConfig("model-tree-overlap", "model", md, mk, mb, adaptive=True, overlap=True),
        ServeConfig("hybrid", "model", nd, mk, nb, adaptive=True, hybrid=True),
    ]
    bf16 = dict(dtype="bfloat16")
    changes = {  # each of report.TWINS: the bfloat16 twins of every row
        "-bf16": bf16,
        "-bf16-cores": dict(bf16, kernel_threads=cores),
        "-bf16-cores-noamx": dict(bf16, kernel_threads=cores, amx=False),
        "-bf16-cores-noblocks": dict(bf16, kernel_threads=cores, compiled_blocks=False),
        "-bf16-cores-calls": dict(bf16, kernel_threads=cores, worker_streams=False),
    }
    twins = [
        replace(c, name=c.name + suffix, **change)
        for suffix, change in changes.items()
        for c in base
    ]
    return {c.name: c for c in base + twins}


def all_rows(configs: dict[str, ServeConfig]) -> list[str]:
    """--rows all: the peers, every float32 row, and speculation off and the default in each
    bfloat16 variant (the other twins on request)."""
    kept = ("off-bf16", "ngram-tree-adaptive-bf16")
    return list(HF_ROWS) + [
        r
        for r, c in configs.items()
        if c.dtype == "float32" or (r.startswith(kept) and c.compiled_blocks and c.worker_streams)
    ]


@dataclass
class Result:
    """One row on one workload at one concurrency."""

    row: str
    setup: str  # what the row is, in words
    workload: str
    streams: int
    figures: Figures
    same: bool | None  # every text equal to the reference's
    phases_ms: dict[str, float | None] = field(default_factory=dict)  # p50 per round phase
    load: float = 0.0  # 1-minute load average when the row finished
    # tok/s of every serve the row had at its point, in turn order (`run_serves`; the
    # median serve stands for the row and keeps them)
    turns: list[float] = field(default_factory=list)


@dataclass
class Run:
    settings: BenchSettings
    machine: str
    draft: str  # the model draft, in words
    started_load: tuple[float, float, float]
    results: list[Result] = field(default_factory=list)
    # "workload numerics" -> conversation key -> text
    references: dict[str, dict[int, str]] = field(default_factory=dict)
    seconds: float = 0.0

    def check(self, workload: str, timed: list[Timed], numerics: str = "float32") -> bool:
        """Texts equal to the reference of the row's numerics (ServeConfig.numerics: a
        bfloat16 target's greedy text is its own); the first such row to run a conversation
        sets it."""
        reference = self.references.setdefault(f"{workload} {numerics}", {})
        same = True
        for t in timed:
            expected = reference.setdefault(t.key, t.text)
            same &= t.text == expected
        return same


def run_suite(s: BenchSettings) -> Run:
    from workers.engine.loader import load_tokenizer, resolve_model

    started = time.perf_counter()
    configs = serve_configs(s)
    rows = all_rows(configs) if s.rows == "all" else s.names(s.rows)
    unknown = [r for r in rows if r not in HF_ROWS and r not in configs]
    if unknown:
        raise SystemExit(f"unknown rows: {', '.join(unknown)}")
    unswept = [r for r in s.names(s.sweep_rows) if r not in rows]
    if unswept and "sweep_rows" in s.model_fields_set:  # the default sweeps those of --rows
        raise SystemExit(f"--sweep-rows {', '.join(unswept)}: not among --rows, so not run")
    target_dir = resolve_model(s.target_model)
    tokenizer = load_tokenizer(target_dir)
    needs_draft = any(
        r == "hf-assisted" or (r in configs and configs[r].draft == "model") for r in rows
    )
    draft_dir, draft_words = (
        draft_model_dir(s.draft_model, target_dir) if needs_draft else (None, "")
    )
    run = Run(s, describe(), draft_words, load_average())
    workloads = {
        w: messages(w, s.humaneval if w == "humaneval" else s.prompts) for w in s.names(s.workloads)
    }
    hf_rows = [r for r in rows if r in HF_ROWS]
    if hf_rows:  # the reference first: hf-generate is the text every row must match
        run_hf(run, hf_rows, workloads, target_dir, draft_dir, tokenizer)
        gc.collect()
    run_serves(run, [configs[r] for r in rows if r not in HF_ROWS], workloads, draft_dir, tokenizer)
    run.seconds = time.perf_counter() - started
    return run


def run_hf(run: Run, rows: list[str], workloads, target_dir, draft_dir, tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    from workers.engine.text import encode_chat
    from workers.tools.bench.hf_rows import hf_request

    s = run.settings
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = None
    if "hf-assisted" in rows:
        draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    kwargs = {
        "hf-generate": {},
        "hf-assisted": {"assistant_model": draft},
        "hf-prompt-lookup": {"prompt_lookup_num_tokens": 10},
    }
    setups = {
        "hf-generate": "transformers generate, greedy, target only",
        "hf-assisted": "transformers assisted generation (assistant_model = the model draft)",
        "hf-prompt-lookup": "transformers prompt lookup (prompt_lookup_num_tokens=10)",
    }
    order = sorted(rows, key=lambda r: r != "hf-generate")  # the reference text first
    for row in order:
        hf_request(target, tokenizer, [1, 2, 3, 4], 4, **kwargs[row])  # warm-up
        for workload, conversations in workloads.items():
            timed = []
            start = time.perf_counter()
            for key, conversation in enumerate(conversations):
                prompt = encode_chat(tokenizer, conversation)
                t = hf_request(target, tokenizer, prompt, s.max_tokens, **kwargs[row])
                t.key = key
                timed.append(t)
            wall = time.perf_counter() - start
            result = Result(
                row, setups[row], workload, 1, Figures.of(timed, wall), run.check(workload, timed)
            )
            result.load = load_average()[0]
            run.results.append(result)
            print(report.progress(result), flush=True)


def serve_points(s: BenchSettings, config: ServeConfig, workloads) -> list[tuple[str, int]]:
    """The (workload, streams) points a SpecSplit row measures: one stream on every
    workload, and the sweep's other stream counts on the sweep workload for a swept row."""
    points = [(workload, 1) for workload in workloads]
    if config.name in s.names(s.sweep_rows) and s.sweep_workload in workloads:
        points += [(s.sweep_workload, int(n)) for n in s.names(s.streams) if int(n) != 1]
    return points


def run_serves(run: Run, configs: list[ServeConfig], workloads, draft_dir, tokenizer) -> None:
    """Every SpecSplit row at each of its points. At a point the rows take turns, each
    `repeats` times, so that a slow minute of the machine falls on every row alike; the
    serve with the median tok/s stands for its row there."""
    s = run.settings

    def count_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    points = {c.name: serve_points(s, c, workloads) for c in configs}
    # a row's workers hold every session of its largest point
    sessions = {name: max(8, *(n for _, n in row)) for name, row in points.items()}
    order = list(dict.fromkeys(p for c in configs for p in points[c.name]))
    for workload, n in order:
        rows = [c for c in configs if (workload, n) in points[c.name]]
        tried: dict[str, list[Result]] = {c.name: [] for c in rows}
        for _ in range(s.repeats):
            for config in rows:
                with Serve(
                    config,
                    s.target_model,
                    draft_dir,
                    sessions[config.name],
                    s.knee_tokens,
                    s.worker_threads,
                ) as serve:
                    greeting = warm_up(workloads[workload])
                    asyncio.run(run_streams(serve.url, [greeting], 1, 1, 8, count_tokens))
                    conversations = workloads[workload]
                    result = measure(run, serve, config, workload, n, conversations, count_tokens)
                    tried[config.name].append(result)
        for config in rows:
            results = sorted(tried[config.name], key=lambda r: r.figures.tok_s_total)
            median = results[len(results) // 2]
            median.same = all(r.same for r in results)
            median.turns = [r.figures.tok_s_total for r in tried[config.name]]
            run.results.append(median)
            if s.repeats > 1:
                print(f"median of {s.repeats}: {report.progress(median)}", flush=True)


def measure(
    run: Run, serve: Serve, config, workload: str, n: int, conversations, count_tokens
) -> Result:
    """Sends the workload's conversations over `n` streams; prints and returns the result."""
    s = run.settings
    per_stream = requests_per_stream(len(conversations), n, s.min_requests_per_stream)
    before = phase_buckets(serve.url)
    timed, wall = asyncio.run(
        run_streams(serve.url, conversations, n, per_stream, s.max_tokens, count_tokens)
    )
    phases = bucket_delta(phase_buckets(serve.url), before)
    p50 = {phase: _ms(histogram_quantile(buckets, 0.5)) for phase, buckets in phases.items()}
    result = Result(
        config.name,
        config.describe(),
        workload,
        n,
        Figures.of(timed, wall),
        run.check(workload, timed, config.numerics()),
        p50,
        load_average()[0],
    )
    print(report.progress(result), flush=True)
    return result


def requests_per_stream(prompts: int, streams: int, at_least: int) -> int:
    """What each of `streams` streams sends: the prompts once between them, at least
    `at_least`."""
    return max(at_least, math.ceil(prompts / streams))


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def main(argv: list[str]) -> None:
    from workers.settings import parse

    s = parse(BenchSettings, argv)
    run = run_suite(s)
    s.out.mkdir(parents=True, exist_ok=True)
    paths = report.write(run, s.out)
    print(report.markdown(run))
    print("wrote " + ", ".join(str(p) for p in paths))
