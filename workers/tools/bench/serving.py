"""SpecSplit rows: a `specsplit serve` of its own per configuration, driven over HTTP.

`ServeProcess` starts `python -m workers.tools.cli serve` (gateway in that
process, the target and any draft as gRPC worker processes) and waits for its
ready line; `Serve` is one with a configuration's tree flags. `stream_chat`
sends one streaming chat completion with httpx and times its chunks;
`run_streams` keeps N requests running at once, each stream taking the next
request of one queue when its last one finished. `histogram_buckets` reads one
of the gateway's histograms from /metrics."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import httpx

from workers.draft.ngram import MIN_MATCH
from workers.tools.bench.measure import Timed

MODEL_NAME = "bench"  # the name the bench's serve answers to


@dataclass(frozen=True)
class ServeConfig:
    """One SpecSplit row: which draft, which tree, which loop."""

    name: str  # the row's name (--rows)
    draft: str  # "none", "ngram" or "model"
    depth: int = 0  # most tree levels
    branching: int = 1  # 1 = chain
    budget: int = 0  # most tree nodes
    adaptive: bool = False  # adaptive trees (gateway.adaptive)
    overlap: bool = False  # the overlapped loop (gateway.overlap)
    hybrid: bool = False  # the model draft's trees merged with the gateway's n-gram draft
    prefix_caching: bool = True  # the workers share KV blocks of common prompt prefixes
    min_match: int = MIN_MATCH  # the n-gram draft's shortest match (--ngram-min-match)
    dtype: str = "float32"  # the workers' --dtype
    kernel_threads: int = 0  # the workers' --kernel-threads; 0 = their torch threads
    amx: bool = True  # the workers' --amx: the bfloat16 kernel on the AMX tile unit if any
    compiled_blocks: bool = True  # the workers' --compiled-blocks (the same bits either way)
    worker_streams: bool = True  # the gateway's --worker-streams: Verify as stream messages

    def describe(self) -> str:
        extras = ("" if self.prefix_caching else ", no prefix caching") + (
            "" if self.dtype == "float32" else f", {self.dtype}"
        )
        if self.kernel_threads:
            extras += f", kernel on {self.kernel_threads} threads"
        if not self.amx:
            extras += ", AMX off"
        if not self.compiled_blocks:
            extras += ", blocks op by op"
        if not self.worker_streams:
            extras += ", Verify as calls"
        return self.speculation() + extras

    def numerics(self) -> str:
        """What the workers' greedy text depends on: the dtype, and in bfloat16 whether the
        kernel runs on the AMX tile unit (the two round differently)."""
        return self.dtype if self.dtype == "float32" or self.amx else f"{self.dtype}, AMX off"

    def speculation(self) -> str:
        if self.draft == "none":
            return "speculation off"
        shape = (
            f"chain, depth {self.depth}"
            if self.branching == 1
            else f"tree, depth {self.depth}, {self.budget} nodes"
        )
        options = (("hybrid", self.hybrid), ("adaptive", self.adaptive), ("overlap", self.overlap))
        extras = [x for x, on in options if on]
        if self.draft == "ngram" and self.min_match != MIN_MATCH:
            extras.append(f"after {self.min_match}-token matches")
        return f"{self.draft} {shape}" + (f", {' + '.join(extras)}" if extras else "")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`specsplit serve ARGS` in a subprocess (on a free port), until its ready line; from
    another checkout's .venv with `checkout` (to time another branch side by side)."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        timeout_s=600.0,
        checkout: Path | None = None,
    ):
        self.port = free_port()
        python = sys.executable if checkout is None else str(checkout / ".venv" / "bin" / "python")
        self.cwd = checkout
        serve = [python, "-m", "workers.tools.cli", "serve", "--port", str(self.port)]
        if checkout is None:  # this build's serve: it ends if the bench is killed outright
            serve += ["--parent-pid", str(os.getpid())]
        self.command = [*serve, *args]
        self.env = env or dict(os.environ)
        self.timeout_s = timeout_s
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServeProcess:
        self.process = subprocess.Popen(
            self.command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
            cwd=self.cwd,
        )
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + self.timeout_s
        while not self.ready.wait(1.0):  # a serve that exits is not waited for to the end
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError("serve did not get ready:\n" + "".join(self.lines[-30:]))
        return self

    def _drain(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)
            if line.startswith("SpecSplit ready: "):
                self.ready.set()

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class Serve(ServeProcess):
    """`specsplit serve` for one configuration of the suite."""

    def __init__(
        self,
        config: ServeConfig,
        target_model: str,
        draft_model: str | None,
        max_sessions: int,
        knee_tokens: float,
        worker_threads: int = 0,
        timeout_s: float = 600.0,
    ):
        self.config = config
        draft = draft_model if config.draft == "model" else config.draft
        args = ["--target-model", target_model, "--served-model-name", MODEL_NAME]
        args += ["--draft-model", str(draft), "--log-level", "warning"]
        args += ["--worker-max-sessions", str(max_sessions), "--max-sessions", "256"]
        args += ["--tree-depth", str(config.depth), "--tree-branching", str(config.branching)]
        args += ["--tree-budget", str(config.budget)]
        args += ["--adaptive-tree" if config.adaptive else "--no-adaptive-tree"]
        args += ["--overlap-draft" if config.overlap else "--no-overlap-draft"]
        args += ["--hybrid-draft" if config.hybrid else "--no-hybrid-draft"]
        args += ["--adaptive-knee-tokens", str(knee_tokens)]
        args += ["--ngram-min-match", str(config.min_match)]
        args += ["--dtype", config.dtype, "--kernel-threads", str(config.kernel_threads)]
        args += ["--amx" if config.amx else "--no-amx"]
        args += ["--compiled-blocks" if config.compiled_blocks else "--no-compiled-blocks"]
        if not config.prefix_caching:
            args += ["--no-worker-prefix-caching"]
        if not config.worker_streams:
            args += ["--no-worker-streams"]
        env = dict(os.environ)
        if worker_threads > 0:  # the workers' torch threads (the gateway barely uses torch)
            env["OMP_NUM_THREADS"] = str(worker_threads)
        super().__init__(args, env, timeout_s)


async def stream_chat(
    client: httpx.AsyncClient,
    url: str,
    messages: list[dict],
    max_tokens: int,
    count_tokens,
    extra: dict | None = None,
    api_key: str = "",
) -> Timed:
    """One streaming chat completion, greedy unless `extra` says otherwise; `count_tokens(text)`
    sizes each chunk; `extra` adds fields to the body (or replaces them: a `temperature`);
    `api_key` (its Bearer) picks the request's suffix-cache tenant."""
    body = {
        "model": MODEL_NAME,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "speculation_stats": True,
        **(extra or {}),
    }
    timed = Timed(time.perf_counter())
    texts: list[str] = []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    endpoint = url + "/v1/chat/completions"
    async with client.stream("POST", endpoint, json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            for choice in chunk.get("choices", []):
                text = choice.get("delta", {}).get("content") or ""
                if text:
                    texts.append(text)
                    timed.chunks.append((now, 0))
            if chunk.get("usage"):
                timed.tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("speculation_stats"):
                timed.stats = chunk["speculation_stats"]
    timed.end = time.perf_counter()
    timed.text = "".join(texts)
    spread_tokens(timed, [count_tokens(t) for t in texts])
    return timed


def spread_tokens(timed: Timed, counts: list[int]) -> None:
    """Gives each chunk its share of the response's tokens, in proportion to `counts`
    (its text re-tokenized), so that the shares add up to the usage count."""
    total = sum(counts)
    if not total:
        return
    given = 0
    for i, ((at, _), n) in enumerate(zip(timed.chunks, counts, strict=True)):
        share = round((given + n) * timed.tokens / total) - round(given * timed.tokens / total)
        timed.chunks[i] = (at, share)
        given += n


async def run_streams(
    url: str,
    conversations: list[list[dict]],
    streams: int,
    requests_per_stream: int,
    max_tokens: int,
    count_tokens,
    extra: dict | None = None,
) -> tuple[list[Timed], float]:
    """`streams` clients sending `streams * requests_per_stream` requests between them.

    Request j asks conversation j (cycled). The requests form one queue, and each
    client takes the next as soon as its last one finished, as vLLM's
    `benchmark_serving --max-concurrency` does: `streams` requests run at once until
    the queue is empty, and the wave ends at most one request after the others. (With
    a fixed share per client, a client whose requests went fast would sit idle while
    the others finished theirs, and the wave would end on the slowest share: that
    measured how unevenly a configuration speeds requests, not its throughput.) Each
    request is a tenant of its own (a fresh Bearer key; the bench's serves accept any):
    the requests repeat the prompts, and the suffix cache a tenant's requests share
    would copy the earlier answers to the same prompt (`specsplit bench suffix`
    measures that gain on purpose). `extra` adds fields to every request's body. Returns
    every request's timing, in request order, and the wall time."""
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    timeout = httpx.Timeout(600.0)
    total = streams * requests_per_stream
    queue = deque(range(total))
    timings: list[Timed | None] = [None] * total
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def stream() -> None:
            while queue:
                j = queue.popleft()
                key = j % len(conversations)
                messages, api_key = conversations[key], secrets.token_hex(8)
                timed = await stream_chat(
                    client, url, messages, max_tokens, count_tokens, extra, api_key
                )
                timed.key = key
                timings[j] = timed

        start = time.perf_counter()
        await asyncio.gather(*(stream() for _ in range(streams)))
        wall = time.perf_counter() - start
    return [t for t in timings if t is not None], wall


def children(pid: int) -> list[int]:
    """The processes `pid` started (a serve's workers)."""
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def worker_rss_mib(serve: ServeProcess) -> dict[int, float]:
    """Resident memory of each worker process that `serve` started: {pid: MiB}."""
    out = {}
    for child in children(serve.process.pid):
        status = Path(f"/proc/{child}/status").read_text()
        kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
        out[child] = kib / 1024
    return out


def histogram_buckets(url: str, name: str, label: str = "") -> dict[str, list[tuple[float, float]]]:
    """A histogram's buckets from /metrics: {value of `label` ("" without): [(le, cumulative)]}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    out: dict[str, list[tuple[float, float]]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                out.setdefault(sample.labels.get(label, ""), []).append((le, sample.value))
    return out


def phase_buckets(url: str) -> dict[str, list[tuple[float, float]]]:
    """specsplit_round_phase_seconds buckets by phase: {phase: [(le, cumulative count)]}."""
    return histogram_buckets(url, "specsplit_round_phase_seconds", "phase")


def bucket_delta(
    after: dict[str, list[tuple[float, float]]], before: dict[str, list[tuple[float, float]]]
) -> dict[str, list[tuple[float, float]]]:
    """The histogram of what happened between two scrapes."""
    out = {}
    for phase, buckets in after.items():
        earlier = dict(before.get(phase, []))
        out[phase] = [(le, count - earlier.get(le, 0.0)) for le, count in buckets]
    return out


def first8_draft(target_dir: Path, cache: Path) -> Path:
    """The target's first 8 layers under its own head, saved once as a model directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = cache / "bench" / "smollm2-135m-first8"
    if (path / "config.json").exists():
        return path
    model = AutoModelForCausalLM.from_pretrained(target_dir, num_hidden_layers=8)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(target_dir).save_pretrained(tmp)
    tmp.rename(path)
    return path


def draft_model_dir(spec: str, target_dir: Path) -> tuple[Path, str]:
    """The model draft to bench, and how to describe it. `auto`: the distilled draft
    `smollm2-135m-draft` when it is installed, else the target's first 8 layers."""
    from workers.engine.loader import ModelNotFoundError, default_cache_dir, resolve_model

    if spec != "auto":
        return resolve_model(spec), spec
    try:
        return resolve_model("smollm2-135m-draft"), "smollm2-135m-draft (distilled)"
    except ModelNotFoundError:
        path = first8_draft(target_dir, default_cache_dir())
        return path, "the target's first 8 layers (no distilled draft installed)"
