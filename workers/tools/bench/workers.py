"""`specsplit bench workers`: worker throughput over gRPC.

Starts a target worker on the embedded model (SmolLM2-135M-Instruct) and an
n-gram draft worker in this process, on localhost ports, then runs the
speculation loop (workers.loop over GrpcBackend) for 1, 4 and 8 concurrent
sessions on HumanEval prompts, greedy (`--draft none`: no draft, one token per
round). Clients and both servers share this process and its event loop, which
is itself part of what is measured. Prints a Markdown table: aggregate verified
tokens/s (tokens the target committed, accepted + bonus, over all sessions) and
its ratio to one session, the target's mean batch size, and the bytes on the
wire per round (serialized request + response of Propose and of Verify).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, replace
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings

from workers.engine.engine import Engine, EngineConfig
from workers.engine.text import encode
from workers.loop import Pair, Plan, Route, generate
from workers.protocol import TreeSpec, check_pair
from workers.rpc.client import GrpcBackend, Wire
from workers.rpc.service import serve_role
from workers.settings import EMBEDDED_MODEL, parse, settings_config
from workers.speculation.sampling import SamplingParams
from workers.tools.bench.machine import describe
from workers.tools.bench.workloads import humaneval_prompts
from workers.worker import WorkerSettings


class BenchWorkersSettings(BaseSettings):
    model_config = settings_config("bench workers")

    model: str = Field(EMBEDDED_MODEL, description="the target model")
    sessions: list[int] = Field([1, 4, 8], description="concurrent sessions to measure")
    max_tokens: int = Field(48, ge=1, description="new tokens per session")
    draft: Literal["ngram", "none"] = Field("ngram", description="n-gram draft worker, or none")
    tree_depth: int = Field(6, ge=0, description="n-gram draft tree depth")
    tree_budget: int = Field(16, ge=0, description="n-gram draft tree nodes")
    batch_wait_ms: float = Field(2.0, ge=0, description="the target's batching window")


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


async def measure(
    plans: list[Plan], route: Route, target: GrpcBackend, draft: GrpcBackend, server
) -> Row:
    """Runs the plans as concurrent sessions, one each."""
    wire_t, wire_d = Wire(**vars(target.wire)), Wire(**vars(draft.wire))
    batches = batch_stats(server)
    start = time.perf_counter()
    gens = await asyncio.gather(*(generate(route, plan, uuid.uuid4().hex) for plan in plans))
    seconds = time.perf_counter() - start
    total, count = (a - b for a, b in zip(batch_stats(server), batches, strict=True))
    return Row(
        sessions=len(plans),
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


async def served_rows(
    engine: Engine,
    plans: list[Plan],
    sessions: list[int],
    draft: bool,
    batch_wait_ms: float,
    streaming: bool = True,
) -> list[Row]:
    """Serves `engine` as a target worker (beside an n-gram draft worker where `draft`) on
    localhost and runs the first n plans as concurrent sessions for each n of `sessions`,
    after a short warm-up generation; `streaming` False: the round's calls as unary calls,
    not stream messages."""
    worker = dict(
        host="127.0.0.1", port=0, metrics_port=0, health_port=0, drain_s=0.0, insecure=True
    )
    target_server = await serve_role(
        "target", engine, WorkerSettings(role="target", batch_wait_ms=batch_wait_ms, **worker)
    )
    draft_server = await serve_role("draft", None, WorkerSettings(role="draft", **worker))
    try:
        async with (
            GrpcBackend("target", f"127.0.0.1:{target_server.port}", streaming=streaming) as target,
            GrpcBackend("draft", f"127.0.0.1:{draft_server.port}", streaming=streaming) as drafts,
        ):
            if draft:
                check_pair(await drafts.info(), await target.info())
            route = await Pair.of(target, drafts if draft else None)
            warm_up = replace(plans[0], prompt=plans[0].prompt[:32], max_tokens=8)
            await generate(route, warm_up, uuid.uuid4().hex)
            return [
                await measure(plans[:n], route, target, drafts, target_server) for n in sessions
            ]
    finally:
        await target_server.shutdown(0)
        await draft_server.shutdown(0)


async def run(s: BenchWorkersSettings) -> None:
    most = max(s.sessions)
    engine = Engine.load(EngineConfig(model=s.model, max_sessions=most))
    spec = TreeSpec(depth=s.tree_depth, budget=s.tree_budget)
    plans = [
        Plan(encode(engine.tokenizer, p), s.max_tokens, SamplingParams(), spec)
        for p in humaneval_prompts(most)
    ]
    rows = await served_rows(engine, plans, s.sessions, s.draft == "ngram", s.batch_wait_ms)
    widest = max(rows, key=lambda r: r.sessions).outputs
    same = all(r.outputs == widest[: r.sessions] for r in rows)
    drafting = f"n-gram draft (depth {s.tree_depth}, budget {s.tree_budget})"
    if s.draft == "none":
        drafting = "no draft (one token per round)"
    print(
        f"target {s.model}, {drafting}, {s.max_tokens} new tokens per session, greedy, "
        f"HumanEval prompts, batch wait {s.batch_wait_ms} ms"
    )
    print(f"machine: {describe()}, device {engine.device}")
    print()
    print(table(rows))
    print()
    print("each session's tokens identical at every concurrency: " + ("yes" if same else "NO"))


def main(argv: list[str]) -> None:
    asyncio.run(run(parse(BenchWorkersSettings, argv)))
