"""A soak (`make chaos`, marker `slow`): a few hundred mixed requests from 8 concurrent clients
against one real `specsplit serve` (one SmolLM2 target, the in-gateway n-gram draft): chat and
completions, streamed or not, greedy or sampled; a fifth of the streams are dropped by their
client after two chunks.

It asserts no errors, every greedy answer equal to the one the same request got alone before
the soak (batching changes nothing), 0 sessions left on the gateway and the worker, and the
worker's memory (RSS) flat after warm-up; it prints its figures for README's Reliability.
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from openai import OpenAI

from tests.gateway.helpers import sample, wait_until
from tests.gateway.test_serve import MODEL, Serve, live_sessions

CLIENTS = 8
WARM_UP = 48  # requests before the first memory reading
REQUESTS = 320  # after it
MAX_TOKENS = 16
MAX_RSS_GROWTH = 0.10
PROMPTS = (
    "Tell me a short story about a cat and a dog.",
    "What is the capital of France?",
    "List three colours of the rainbow.",
    "Why is the sky blue?",
)


@dataclass(frozen=True)
class Request:
    chat: bool
    stream: bool
    greedy: bool
    drop: bool  # the client closes the stream after two chunks
    prompt: str

    @property
    def key(self) -> tuple[bool, str]:
        return self.chat, self.prompt


def mix(n: int) -> list[Request]:
    """n requests cycling through every kind (chat, stream, greedy) with each prompt."""
    kinds = list(itertools.product((True, False), repeat=3))
    cycle = [(kind, prompt) for prompt in PROMPTS for kind in kinds]
    requests = []
    for i in range(n):
        (chat, stream, greedy), prompt = cycle[i % len(cycle)]
        requests.append(Request(chat, stream, greedy, stream and i % 5 == 0, prompt))
    return requests


def send(client: OpenAI, r: Request, seed: int) -> str:
    """The text the request got (what arrived before the drop for a dropped one)."""
    kw = dict(max_tokens=MAX_TOKENS, temperature=0 if r.greedy else 0.8, seed=seed, stream=r.stream)
    if r.chat:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": r.prompt}], **kw
        )
    else:
        reply = client.completions.create(model=MODEL, prompt=r.prompt, **kw)
    if not r.stream:
        choice = reply.choices[0]
        return choice.message.content if r.chat else choice.text
    text = ""
    for i, chunk in enumerate(reply):
        if chunk.choices:
            delta = chunk.choices[0]
            text += (delta.delta.content or "") if r.chat else delta.text
        if r.drop and i == 1:
            reply.close()
            break
    return text


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def run(url: str, requests: list[Request]) -> list[str | Exception]:
    clients = [
        OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300) for _ in range(CLIENTS)
    ]

    def one(i: int) -> str | Exception:
        try:
            return send(clients[i % CLIENTS], requests[i], seed=i)
        except Exception as error:  # noqa: BLE001 - counted and shown by the test
            return error

    with ThreadPoolExecutor(CLIENTS) as pool:
        return list(pool.map(one, range(len(requests))))


@pytest.mark.slow
@pytest.mark.embedded
@pytest.mark.timeout(1800)  # 149 s at load average 3 to 8; past the default 600 s at 13
def test_soak_of_mixed_requests_leaves_nothing_and_memory_flat(tmp_path):
    serve = Serve(tmp_path)
    serve.wait_ready()
    try:
        url = serve.state["url"]
        (worker,) = serve.state["workers"]
        alone = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
        greedy = {  # each greedy request alone, before the soak
            (chat, p): send(alone, Request(chat, False, True, False, p), seed=0)
            for chat in (True, False)
            for p in PROMPTS
        }
        assert not [r for r in run(url, mix(WARM_UP)) if isinstance(r, Exception)]
        rss = [rss_kib(worker["pid"])]  # after the warm-up, then after each quarter
        started = time.monotonic()
        requests, results = mix(REQUESTS), []
        for quarter in range(4):
            results += run(url, requests[quarter * REQUESTS // 4 : (quarter + 1) * REQUESTS // 4])
            rss.append(rss_kib(worker["pid"]))
        soak_s = time.monotonic() - started
        errors = [r for r in results if isinstance(r, Exception)]
        assert not errors, errors[:3]
        for r, text in zip(requests, results, strict=True):
            if r.greedy and not r.drop:
                assert text == greedy[r.key], (r, text)
        wait_until(lambda: live_sessions(serve, worker["address"]) == 0, 30, "worker sessions 0")
        metrics = httpx.get(url.removesuffix("/v1") + "/metrics").text
        assert sample(metrics, "specsplit_live_sessions") == 0
        assert sample(metrics, "specsplit_num_requests_running") == 0
        print(
            f"\nsoak: {REQUESTS} requests ({sum(r.drop for r in requests)} dropped mid-stream) "
            f"from {CLIENTS} clients in {soak_s:.1f} s; 0 errors; worker RSS (MiB) after "
            f"{WARM_UP} warm-up requests, then after each quarter: "
            + ", ".join(f"{kib / 1024:.1f}" for kib in rss)
            + f" ({(rss[-1] - rss[0]) / rss[0]:+.1%}); gateway (serve) RSS "
            f"{rss_kib(serve.process.pid) / 1024:.1f} MiB"
        )
        assert rss[-1] < rss[0] * (1 + MAX_RSS_GROWTH)
    finally:
        assert serve.stop() == 0
