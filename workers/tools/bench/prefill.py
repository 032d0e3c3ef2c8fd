"""`specsplit bench prefill`: running streams' inter-token latency while a long prompt arrives.

Starts `specsplit serve` with `make run`'s defaults plus `--serve-args` (e.g.
`--worker-prefill-chunk 0`), or the serve of another checkout (`--checkout
/work/main`, its own .venv: the branch before, side by side). Starts
`--streams` greedy streaming chat completions; `--settle-s` later (every one
streaming by then), sends one request with a prompt of about
`--prompt-tokens` tokens (max_tokens 1) and waits for it. Prints the p50 /
p99 / max of the running streams' gaps between consecutive chunks: the gaps
that overlap the long request, and for reference those before it.
"""

from __future__ import annotations

import asyncio
import shlex
import time
from pathlib import Path

import httpx
from pydantic import Field
from pydantic_settings import BaseSettings

from workers.settings import EMBEDDED_MODEL, parse, settings_config
from workers.tools.bench.machine import describe, load_words
from workers.tools.bench.measure import Timed, percentile
from workers.tools.bench.serving import MODEL_NAME, ServeProcess, stream_chat
from workers.tools.bench.workloads import TEXTS


class PrefillBenchSettings(BaseSettings):
    model_config = settings_config("bench prefill")

    streams: int = Field(8, ge=1, description="streams running while the long prompt arrives")
    max_tokens: int = Field(200, ge=1, description="new tokens per running stream")
    prompt_tokens: int = Field(1500, ge=1, description="tokens of the long prompt, about")
    settle_s: float = Field(10.0, ge=0, description="seconds from the streams' start to it")
    serve_args: str = Field("", description="extra `specsplit serve` arguments")
    checkout: Path | None = Field(None, description="serve from this checkout's .venv")


def long_prompt(tokens: int) -> str:
    """Text of about `tokens` tokens of the embedded model (the workload's texts, repeated)."""
    from workers.engine.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(EMBEDDED_MODEL))
    text = ""
    while len(tokenizer.encode(text)) < tokens:
        text += " ".join(TEXTS) + "\n"
    ids = tokenizer.encode(text)[:tokens]
    return "Summarize this text in one word.\n\n" + tokenizer.decode(ids)


def gaps(timed: list[Timed], start: float, end: float) -> tuple[list[float], list[float]]:
    """Gaps between consecutive chunks: (overlapping [start, end], ending before start)."""
    during, before = [], []
    for t in timed:
        arrivals = [at for at, _ in t.chunks]
        for a, b in zip(arrivals, arrivals[1:], strict=False):
            if b > start and a < end:
                during.append(b - a)
            elif b <= start:
                before.append(b - a)
    return during, before


async def measure(url: str, s: PrefillBenchSettings, prompt: str) -> tuple:
    """(start, end, prompt tokens) of the long request; (during, before) gaps."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        messages = [
            [{"role": "user", "content": f"Write a long story about the number {i}."}]
            for i in range(s.streams)
        ]
        running = [
            asyncio.create_task(stream_chat(client, url, m, s.max_tokens, lambda text: 1))
            for m in messages
        ]
        await asyncio.sleep(s.settle_s)
        body = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 1,
            "temperature": 0,
        }
        start = time.perf_counter()
        response = await client.post(url + "/v1/chat/completions", json=body)
        end = time.perf_counter()
        response.raise_for_status()
        prompt_tokens = response.json()["usage"]["prompt_tokens"]
        done = await asyncio.gather(*running)
    if any(t.end < end for t in done):
        raise RuntimeError("a stream ended before the long prompt did: raise --max-tokens")
    return (start, end, prompt_tokens), gaps(done, start, end)


def run(s: PrefillBenchSettings) -> str:
    prompt = long_prompt(s.prompt_tokens)
    args = ["--served-model-name", MODEL_NAME, "--log-level", "warning", *shlex.split(s.serve_args)]
    with ServeProcess(args, checkout=s.checkout) as serve:
        load = load_words()
        (start, end, prompt_tokens), (during, before) = asyncio.run(measure(serve.url, s, prompt))

    def figures(values: list[float]) -> str:
        if not values:
            return "none"
        p50, p99 = (1000 * percentile(values, q) for q in (50, 99))
        return f"p50 {p50:.0f} ms, p99 {p99:.0f} ms, max {1000 * max(values):.0f} ms"

    source = f"checkout {s.checkout}" if s.checkout else "this checkout"
    return "\n".join(
        [
            f"machine: {describe()}; load average before {load}",
            f"serve ({source}) {' '.join(args)}",
            f"{s.streams} running streams; a {prompt_tokens}-token prompt answered in "
            f"{end - start:.2f} s",
            f"inter-chunk gaps while it was in flight ({len(during)}): {figures(during)}",
            f"inter-chunk gaps before it ({len(before)}): {figures(before)}",
        ]
    )


def main(argv: list[str]) -> None:
    print(run(parse(PrefillBenchSettings, argv)))
