"""`specsplit bench [KIND] [options]`: every benchmark, behind one registry.

suite.py     `serve` (the default): SpecSplit served against its peers, side by side
serving.py   starting a `specsplit serve` and streaming chat completions at it
hf_rows.py   the transformers rows of the suite
measure.py   timings of one request and the figures of many
report.py    the suite's CSV, Markdown and plot
workloads.py the prompts: input-grounded tasks and HumanEval
engine.py    `engine`: in-process decoding speed on one model
ceiling.py   `ceiling`: n-gram trees vs chains, by replay
workers.py   `workers`: a target and an n-gram draft worker over gRPC
draft.py     `draft`: the figures of a distilled draft (bench/DRAFT.md)
admission.py `admission`: more streams at once than `specsplit serve` holds (the queue)
lossy.py     `lossy`: each lossy acceptance rule's speed and agreement with exact output
prefill.py   `prefill`: running streams' inter-token latency while a long prompt arrives
suffix.py    `suffix`: the suffix cache off vs on, on workloads that repeat across requests
gpu.py       `gpu`: the engine on a CUDA GPU, eager and graphed, vs transformers generate
paired.py    `paired`: the default against speculation off inside one serve, wave by wave
machine.py   the machine every kind reports, described once
"""

from __future__ import annotations

from workers.tools.cli import Table, dispatch

KINDS: Table = {
    "serve": (
        "workers.tools.bench.suite",
        "SpecSplit over HTTP + gRPC vs transformers, every row side by side",
    ),
    "engine": (
        "workers.tools.bench.engine",
        "in-process decoding speed on one model vs transformers generate",
    ),
    "ceiling": ("workers.tools.bench.ceiling", "n-gram trees vs chains by replay (no timing)"),
    "workers": (
        "workers.tools.bench.workers",
        "target + n-gram draft workers over gRPC at 1, 4, 8 sessions",
    ),
    "draft": (
        "workers.tools.bench.draft",
        "a distilled draft: agreement, tokens per forward, cost, tokens/s",
    ),
    "admission": (
        "workers.tools.bench.admission",
        "N streams at once against `specsplit serve`'s defaults: errors, texts, queue time",
    ),
    "lossy": (
        "workers.tools.bench.lossy",
        "lossy acceptance rules vs exact: tokens/s and agreement with the lossless text",
    ),
    "prefill": (
        "workers.tools.bench.prefill",
        "running streams' inter-token latency while a long prompt arrives (chunked prefill)",
    ),
    "suffix": (
        "workers.tools.bench.suffix",
        "the suffix cache off vs on: repeated questions, an agent's file edits",
    ),
    "paired": (
        "workers.tools.bench.paired",
        "the default vs speculation off in one serve, waves taking turns (noise-robust)",
    ),
    "gpu": (
        "workers.tools.bench.gpu",
        "the engine on a CUDA GPU, eager and CUDA graphs, vs transformers generate (1B Llama)",
    ),
}


def main(argv: list[str]) -> None:
    dispatch("specsplit bench", KINDS, argv, default="serve")
