"""Round overhead through the whole stack: `specsplit serve` over a tiny random Llama (the
tests' word-tokenizer model, forwards well under a millisecond), speculation off, streamed
chat completions over HTTP; the target's Verify calls as stream messages against unary
calls (--no-worker-streams), fresh serves taking turns.

    PYTHONPATH=. python bench/runs/2026-11-27-streams/tiny_http.py [REPEATS]

Run from the checkout to time (its tests/ must import). Prints tok/s per serve and point,
then the medians and their ratio; every text must equal the first serve's.
"""

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.gateway.helpers import write_tiny_model
from workers.tools.bench.serving import ServeProcess, stream_chat

PROMPTS = [f"tell me about the number {i} and what comes after it" for i in range(32)]
POINTS = {1: 8, 8: 32}  # streams: requests
MAX_TOKENS = 128


async def wave(url: str, streams: int, requests: int) -> tuple[float, list[str]]:
    """`requests` chat completions, `streams` at a time; tokens/s and the texts."""
    gate = asyncio.Semaphore(streams)
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(prompt: str):
            async with gate:
                messages = [{"role": "user", "content": prompt}]
                return await stream_chat(client, url, messages, MAX_TOKENS, lambda text: 1)

        start = time.perf_counter()
        done = await asyncio.gather(*(one(p) for p in PROMPTS[:requests]))
        seconds = time.perf_counter() - start
    return sum(t.tokens for t in done) / seconds, [t.text for t in done]


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    model = write_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    rates: dict[tuple[str, int], list[float]] = {}
    texts: dict[int, list[str]] = {}
    for _ in range(repeats):
        for mode in ("calls", "stream"):
            args = ["--target-model", str(model), "--draft-model", "none"]
            args += ["--served-model-name", "bench", "--log-level", "warning"]
            args += ["--no-worker-streams"] if mode == "calls" else []
            with ServeProcess(args) as serve:
                asyncio.run(wave(serve.url, 1, 2))  # warm-up
                for streams, requests in POINTS.items():
                    rate, said = asyncio.run(wave(serve.url, streams, requests))
                    assert texts.setdefault(streams, said) == said, "texts differ"
                    rates.setdefault((mode, streams), []).append(rate)
                    print(f"{mode:6s} {streams} streams {rate:8.1f} tok/s", flush=True)
    for streams in POINTS:
        calls = statistics.median(rates[("calls", streams)])
        stream = statistics.median(rates[("stream", streams)])
        ratio = stream / calls
        print(f"{streams} streams: calls {calls:.1f}, stream {stream:.1f} tok/s, {ratio:.2f}x")


if __name__ == "__main__":
    main()
