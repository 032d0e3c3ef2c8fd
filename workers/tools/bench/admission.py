"""`specsplit bench admission`: more streams at once than `specsplit serve` holds.

Starts `specsplit serve` with `make run`'s defaults (embedded target, n-gram
draft in the gateway, one target worker, the default admission queue), or the
serve of another checkout (`--checkout /work/main`: the branch before, side by
side), streams each of `--requests` distinct short prompts alone, greedy, then
all of them at once, and prints: errors (any error stops the run), whether
every concurrent text equals its solo run, the burst's wall time, how many
requests ran at once (the most `specsplit_num_requests_running` read while it
ran, every 0.25 s), the workers' resident memory before and at most during it,
and its queue time p50 / p99 from the gateway's
`specsplit_request_queue_time_seconds` histogram (the scrape after the burst
less the scrape before it, quantiles as Prometheus' histogram_quantile computes
them: within a bucket, interpolated).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from pydantic import Field
from pydantic_settings import BaseSettings

from workers.settings import parse, settings_config
from workers.tools.bench.machine import describe, load_words
from workers.tools.bench.measure import histogram_quantile
from workers.tools.bench.serving import (
    MODEL_NAME,
    ServeProcess,
    bucket_delta,
    histogram_buckets,
    run_streams,
    worker_rss_mib,
)

QUEUE_TIME = "specsplit_request_queue_time_seconds"


class AdmissionBenchSettings(BaseSettings):
    model_config = settings_config("bench admission")

    requests: int = Field(64, ge=1, description="distinct prompts, sent all at once")
    max_tokens: int = Field(32, ge=1, description="new tokens per request")
    checkout: Path | None = Field(None, description="serve from this checkout's .venv")


def prompts(n: int) -> list[list[dict]]:
    """n distinct short chat prompts."""
    return [[{"role": "user", "content": f"Write one short sentence about the number {i}."}]
            for i in range(n)]  # fmt: skip


def running(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    line = next(x for x in text.splitlines() if x.startswith("specsplit_num_requests_running "))
    return float(line.split()[1])


async def watched(serve: ServeProcess, burst) -> tuple[tuple, float, float]:
    """Runs `burst`; returns its result, the most requests running at once and the most
    resident memory of all workers together (MiB) seen meanwhile."""
    task = asyncio.ensure_future(burst)
    most_running, most_rss = 0.0, 0.0
    while not task.done():
        most_running = max(most_running, await asyncio.to_thread(running, serve.url))
        most_rss = max(most_rss, sum(worker_rss_mib(serve).values()))
        await asyncio.wait([task], timeout=0.25)
    return task.result(), most_running, most_rss


def run(s: AdmissionBenchSettings) -> str:
    conversations = prompts(s.requests)

    def count_tokens(text: str) -> int:
        return 1  # only texts and timings are compared here

    args = ["--served-model-name", MODEL_NAME, "--log-level", "warning"]
    with ServeProcess(args, checkout=s.checkout) as serve:
        solo, _ = asyncio.run(
            run_streams(serve.url, conversations, 1, s.requests, s.max_tokens, count_tokens)
        )
        before = histogram_buckets(serve.url, QUEUE_TIME)
        load = load_words()
        idle_rss = sum(worker_rss_mib(serve).values())
        burst = run_streams(serve.url, conversations, s.requests, 1, s.max_tokens, count_tokens)
        (burst, wall), most_running, most_rss = asyncio.run(watched(serve, burst))
        queued = bucket_delta(histogram_buckets(serve.url, QUEUE_TIME), before)[""]
    alone = {t.key: t.text for t in solo}
    same = sum(t.text == alone[t.key] for t in burst)
    p50, p99 = (histogram_quantile(queued, q) for q in (0.5, 0.99))
    return "\n".join(
        [
            f"machine: {describe()}; load average before the burst {load}",
            f"{s.requests} concurrent streaming chat completions, max_tokens {s.max_tokens}, "
            f"temperature 0, against `specsplit serve` with its defaults"
            + (f" (checkout {s.checkout})" if s.checkout else ""),
            "errors: 0",
            f"texts equal to their solo runs: {same} of {len(burst)}",
            f"wall time of the burst: {wall:.1f} s",
            f"requests running at once (not queued), at most: {most_running:.0f}",
            f"workers' resident memory: {idle_rss:.0f} MiB before the burst, "
            f"{most_rss:.0f} MiB at most during it",
            f"queue time p50 {p50:.2f} s, p99 {p99:.2f} s (histogram buckets, interpolated)",
        ]
    )


def main(argv: list[str]) -> None:
    print(run(parse(AdmissionBenchSettings, argv)))
