"""Tokens a second of sampled chat answers (temperature 0.7, top_p 0.9) through `make run`'s
serve, one stream, speculation off and the default taking turns: 8 chat prompts a wave,
64 tokens each.

Usage, from a clone of the commit measured: `PYTHONPATH=$PWD python sampled.py`.
"""

import time

import httpx

from workers.tools.bench.paired import PairedBenchSettings, serve_args
from workers.tools.bench.serving import MODEL_NAME, ServeProcess
from workers.tools.bench.workloads import messages


def wave(url: str, conversations: list[list[dict]], method: str) -> float:
    tokens, start = 0, time.perf_counter()
    for i, conversation in enumerate(conversations):
        body = {
            "model": MODEL_NAME,
            "messages": conversation,
            "max_tokens": 64,
            "temperature": 0.7,
            "top_p": 0.9,
            "seed": i,
            "speculation": {"method": method},
        }
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=300).json()
        tokens += reply["usage"]["completion_tokens"]
    return tokens / (time.perf_counter() - start)


def main() -> None:
    settings = PairedBenchSettings(workload="chat", prompts=8, streams="1")
    conversations = messages("chat", 8)
    with ServeProcess(serve_args(settings, 1)) as serve:
        wave(serve.url, conversations[:2], "off")  # warm
        for turn in range(2):
            for method in ("off", "auto"):
                print(
                    f"turn {turn} {method}: {wave(serve.url, conversations, method):.1f} tokens/s"
                )


if __name__ == "__main__":
    main()
