"""The gateway's text work a generated token: `TextStream.push` over the embedded model's
tokenizer, a round of four tokens at a time, with and without a stop string; prints µs a
token (median of five passes over 20 chat answers' tokens). Run from the repository root:
`.venv/bin/python bench/runs/2026-11-29-detokenize/detok_cost.py`."""

import statistics
import time

from gateway.text import TextStream
from workers.engine.loader import load_tokenizer, resolve_model

ANSWERS = [
    "Sure! Here are three tips for better sleep: 1. Keep a regular schedule. 2. Avoid "
    "screens an hour before bed. 3. Keep your bedroom cool, dark and quiet — café au lait "
    "after noon is a bad idea, and so is a heavy dinner. Über-tired? Nap for 20 minutes.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\nprint([fibonacci(i) for i in range(10)])  # 日本語のコメント 🙂",
] * 10


def passes(tokenizer, ids: list[list[int]], stops: list[str]) -> float:
    start = time.perf_counter()
    for answer in ids:
        stream = TextStream(tokenizer, stops)
        for i in range(0, len(answer), 4):
            stream.push(answer[i : i + 4])
        stream.finish()
    return (time.perf_counter() - start) / sum(map(len, ids)) * 1e6


def main() -> None:
    tokenizer = load_tokenizer(resolve_model("smollm2-135m-instruct"))
    ids = [tokenizer(a, add_special_tokens=False)["input_ids"] for a in ANSWERS]
    for stops in ([], ["\n\n\n"]):
        runs = [passes(tokenizer, ids, stops) for _ in range(5)]
        print(f"stops {stops!r}: {statistics.median(runs):.1f} µs a token (5 passes)")


if __name__ == "__main__":
    main()
