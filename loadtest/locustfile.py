"""Locust load test of SpecSplit's OpenAI API.

    make loadtest URL=http://127.0.0.1:8000 USERS=8 DURATION=60s
    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000   # the web UI

Two kinds of users, one of each by default (`--users 2`), more in that ratio:
  - ChatStreamUser: /v1/chat/completions with stream=true and
    stream_options.include_usage, timing the stream itself;
  - CompletionUser: /v1/completions without streaming.
Prompts are drawn from short, medium and long ones (`--prompt-mix`).

Besides Locust's own request rows, every answer is measured and recorded as
custom events (Locust's `events.request.fire`), which land in the same
statistics, CSV files and HTML report:

  name                  type    "response time" column holds
  TTFT chat             SSE     ms from sending the request to the first content token
  TPOT chat             SSE     ms per output token after the first
  E2E chat              SSE     ms from sending the request to [DONE]
  tokens/s chat         METRIC  completion tokens / seconds of the whole stream
  tokens/s completions  METRIC  completion tokens / seconds of the whole request

(The tokens/s rows are rates, not times: read their "ms" columns as tokens/s.)
Token counts come from the usage block of each answer. An answer without
usage, without [DONE], with an error event, or with no text is a failure.

Past the server's capacity, requests wait in its admission queue (their wait
shows in TTFT and E2E) and fail only with 429 (queue full or waited too long)
or 503; a user then waits the answer's Retry-After before its next request.
`make run`'s defaults serve 64 users (`USERS=64`) without a failure.
"""

from __future__ import annotations

import json
import random
import time
from urllib.parse import urlparse

from locust import HttpUser, between, events, task

SHORT = [
    "Say hello in one short sentence.",
    "What is the capital of France?",
    "Name three colours.",
    "Repeat exactly: the cat sat on the mat.",
]
PARAGRAPH = (
    "Speculative decoding lets a small draft model guess several tokens ahead while a large "
    "target model checks all of the guesses in one forward pass. Every guess the target "
    "agrees with is kept, the first one it rejects is replaced by the target's own token, "
    "and the output is exactly what the target alone would have written. "
)
MEDIUM = [
    PARAGRAPH + "Explain this idea to a new engineer in two sentences.",
    "Summarise the following text in one sentence.\n\n" + PARAGRAPH * 2,
    "Here is a list: apple, banana, cherry, date, elderberry, fig, grape. "
    "Repeat the list, then add two more fruits.",
]
LONG = [
    "Read the notes below and list their three main points.\n\n" + PARAGRAPH * 8,
    "Continue this document with one more paragraph in the same style.\n\n" + PARAGRAPH * 10,
]
PROMPTS = {"short": SHORT, "medium": MEDIUM, "long": LONG}


@events.init_command_line_parser.add_listener
def add_options(parser) -> None:
    parser.add_argument(
        "--model",
        default="",
        env_var="LOCUST_MODEL",
        help="model name to ask for; default: the first one /v1/models lists",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=64,
        env_var="LOCUST_MAX_TOKENS",
        help="max_tokens of every request",
    )
    parser.add_argument(
        "--prompt-mix",
        default="short:5,medium:3,long:2",
        env_var="LOCUST_PROMPT_MIX",
        help="relative weights of short, medium and long prompts",
    )
    parser.add_argument(
        "--api-key",
        default="",
        env_var="LOCUST_API_KEY",
        help="Bearer key, when the gateway has SPECSPLIT_API_KEYS",
    )


def prompt_mix(spec: str) -> tuple[list[str], list[float]]:
    """'short:5,medium:3,long:2' -> (["short", "medium", "long"], [5, 3, 2])."""
    kinds, weights = [], []
    for part in spec.split(","):
        kind, _, weight = part.strip().partition(":")
        if kind not in PROMPTS:
            raise ValueError(f"--prompt-mix: unknown prompt kind {kind!r} (short, medium, long)")
        kinds.append(kind)
        weights.append(float(weight or 1))
    return kinds, weights


def record(request_type: str, name: str, value: float) -> None:
    """One custom event: `value` goes where Locust keeps response times."""
    events.request.fire(
        request_type=request_type,
        name=name,
        response_time=value,
        response_length=0,
        exception=None,
        context={},
    )


class OpenAIUser(HttpUser):
    abstract = True
    pause = between(0.5, 2.0)
    model: str | None = None  # found once, shared by all users
    retry_after = 0.0  # seconds the last refusal (429, 503) asked this user to wait

    def wait_time(self) -> float:
        wait, self.retry_after = max(self.pause(), self.retry_after), 0.0
        return wait

    def refused(self, reply) -> None:
        """A non-200 answer: a failure, and its Retry-After honoured."""
        retry_after = reply.headers.get("Retry-After", "")
        self.retry_after = float(retry_after) if retry_after.isdigit() else 0.0
        reply.failure(f"HTTP {reply.status_code}: {reply.text[:200]}")

    def on_start(self) -> None:
        options = self.environment.parsed_options
        # accept the host with or without the OpenAI-style /v1 suffix
        self.api = "" if urlparse(self.host).path.rstrip("/").endswith("/v1") else "/v1"
        self.headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
        self.max_tokens = options.max_tokens
        self.kinds, self.weights = prompt_mix(options.prompt_mix)
        if options.model:
            OpenAIUser.model = options.model
        elif OpenAIUser.model is None:
            reply = self.client.get(f"{self.api}/models", headers=self.headers, name="models")
            reply.raise_for_status()
            OpenAIUser.model = reply.json()["data"][0]["id"]

    def prompt(self) -> tuple[str, str]:
        kind = random.choices(self.kinds, self.weights)[0]
        return kind, random.choice(PROMPTS[kind])


class ChatStreamUser(OpenAIUser):
    @task
    def chat_stream(self) -> None:
        kind, prompt = self.prompt()
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = time.perf_counter()
        first = None
        usage = None
        done = False
        with self.client.post(
            f"{self.api}/chat/completions",
            json=body,
            headers=self.headers,
            stream=True,
            catch_response=True,
            name=f"chat stream ({kind})",
            timeout=(10, 600),
        ) as reply:
            if reply.status_code != 200:
                self.refused(reply)
                return
            for line in reply.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    reply.failure(f"error event: {event['error'].get('message')}")
                    return
                for choice in event.get("choices") or []:
                    if first is None and (choice.get("delta") or {}).get("content"):
                        first = time.perf_counter()
                if event.get("usage"):
                    usage = event["usage"]
            end = time.perf_counter()
            if not done:
                reply.failure("the stream ended without [DONE]")
                return
            if usage is None:
                reply.failure("no usage block (stream_options.include_usage)")
                return
            tokens = usage["completion_tokens"]
            if first is None or tokens < 1:
                reply.failure("no content token in the stream")
                return
            reply.success()
        record("SSE", "TTFT chat", (first - start) * 1000)
        record("SSE", "E2E chat", (end - start) * 1000)
        if tokens > 1:
            record("SSE", "TPOT chat", (end - first) * 1000 / (tokens - 1))
        record("METRIC", "tokens/s chat", tokens / (end - start))


class CompletionUser(OpenAIUser):
    @task
    def completion(self) -> None:
        kind, prompt = self.prompt()
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens}
        start = time.perf_counter()
        with self.client.post(
            f"{self.api}/completions",
            json=body,
            headers=self.headers,
            catch_response=True,
            name=f"completions ({kind})",
            timeout=(10, 600),
        ) as reply:
            if reply.status_code != 200:
                self.refused(reply)
                return
            answer = reply.json()
            usage = answer.get("usage") or {}
            tokens = usage.get("completion_tokens", 0)
            if not answer.get("choices") or tokens < 1:
                reply.failure(f"no text or no usage: {json.dumps(answer)[:200]}")
                return
            reply.success()
        record("METRIC", "tokens/s completions", tokens / (time.perf_counter() - start))
