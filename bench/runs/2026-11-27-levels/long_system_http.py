"""A feature draft behind a long shared system prompt, through `specsplit serve` and HTTP.

Each row starts its own `specsplit serve` (SmolLM2-135M in bfloat16, an EAGLE head on one
draft worker, tree 3/2/6, not adaptive) and streams chat requests that share a system
prompt of about 1,500 tokens, one after another; the first warms the prefix and the rest
are timed (TTFT and the whole request). With `--worker-prefix-state-mib 0` the target
keeps no states of cached blocks, so every feature session prefills the whole prompt
again (the behaviour before 2026-11-27); with the default 64 a session takes the cached
prefix with its states. Speculation off is the reference. Every row's texts must be
speculation off's.

    PYTHONPATH=. python bench/runs/2026-11-27-levels/long_system_http.py HEAD_DIR [WORDS]
"""

import json
import os
import statistics
import subprocess
import sys
import threading
import time

import httpx

from gateway.serve import free_port

QUESTIONS = [f"What is {i} times {i + 3}? Answer briefly." for i in range(6)]


def serve(port: int, *args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "workers.tools.cli", "serve", "--port", str(port)]
    command += ["--dtype", "bfloat16", "--parent-pid", str(os.getpid()), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    ready = threading.Event()

    def drain() -> None:
        for line in process.stdout:
            if line.startswith("SpecSplit ready: "):
                ready.set()

    threading.Thread(target=drain, daemon=True).start()
    if not ready.wait(300):
        process.kill()
        raise RuntimeError("serve did not get ready")
    return process


def ask(client: httpx.Client, system: str, question: str) -> tuple[float, float, str]:
    body = {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 48,
        "temperature": 0,
        "stream": True,
    }
    start, first, text = time.perf_counter(), None, []
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            if delta and first is None:
                first = time.perf_counter() - start
            text.append(delta)
    return first or 0.0, time.perf_counter() - start, "".join(text)


def row(name: str, system: str, *args: str) -> list[str]:
    port = free_port()
    process = serve(port, *args)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            ask(client, system, "Hello.")  # warms the prefix
            runs = [ask(client, system, q) for q in QUESTIONS]
    finally:
        process.terminate()
        process.wait(60)
    ttft = statistics.median(r[0] for r in runs) * 1e3
    whole = statistics.median(r[1] for r in runs) * 1e3
    print(f"{name}: TTFT p50 {ttft:.0f} ms, request p50 {whole:.0f} ms", flush=True)
    return [r[2] for r in runs]


def main() -> None:
    head, words = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 400
    system = "You are a careful assistant. " + " ".join(f"rule{i}" for i in range(words))
    feature = ["--draft-model", head, "--drafts", "1", "--no-adaptive-tree"]
    feature += ["--tree-depth", "3", "--tree-branching", "2", "--tree-budget", "6"]
    rows = [
        ("speculation off", ["--draft-model", "none"]),
        ("head, prefix states 0 MiB", [*feature, "--worker-prefix-state-mib", "0"]),
        ("head, prefix states 64 MiB", feature),
    ]
    reference = None
    for turn in range(2):
        for name, args in rows:
            texts = row(f"{name} (turn {turn + 1})", system, *args)
            reference = reference or texts
            assert texts == reference, f"{name}: texts differ from speculation off's"
    print("every row's texts equal speculation off's")


if __name__ == "__main__":
    main()
