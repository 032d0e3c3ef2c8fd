"""The `specsplit worker` command, health, Info, metrics names, and draining on shutdown."""

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.distill.conftest import save_tiny_target
from tests.engine.tiny import tiny_engine
from tests.gateway.helpers import wait_until
from tests.gateway.test_serve import alive
from tests.workers.helpers import scrape, target_worker
from workers.engine.bf16_linear import bf16_kernel
from workers.protocol import ProposeCall, TreeSpec, VerifyCall
from workers.rpc.client import GrpcBackend
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree
from workers.worker import run_loop

ROOT = Path(__file__).resolve().parents[2]
START = VerifyCall("s", 0, [1, 2, 3], TokenTree.empty(), SamplingParams())  # a session's start
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
METRICS = [
    "specsplit_worker_batch_size",
    "specsplit_worker_tokens_per_forward",
    "specsplit_worker_forward_seconds",
    "specsplit_worker_queue_seconds",
    "specsplit_worker_live_sessions",
    "specsplit_worker_evictions_total",
    "specsplit_worker_prompt_tokens_total",
    "specsplit_worker_prefix_cache_tokens",
    "specsplit_worker_requests_total",
]


async def read_port(stream: asyncio.StreamReader) -> int:
    while line := await stream.readline():
        found = re.search(rb"serving .* on [\d.]+:(\d+)", line)
        if found:
            return int(found.group(1))
    raise AssertionError("the worker exited before serving")


async def test_worker_command_serves_and_drains_on_sigterm():
    env = {**os.environ, "SPECSPLIT_MAX_SESSIONS": "5"}  # flags and environment both work
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "workers.tools.cli", "worker", "draft", "--model", "ngram",
        "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--drain-s", "0.5",
        "--insecure", "--health-port", "0",
        cwd=ROOT, env=env, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        port = await asyncio.wait_for(read_port(proc.stderr), 120)
        async with GrpcBackend("draft", f"127.0.0.1:{port}") as draft:
            info = await draft.info()
            assert (info.role, info.model_id, info.max_sessions) == ("draft", "ngram", 5)
            assert await draft.health()
            history = [1, 2, 3, 1, 2, 3, 1, 2]
            tree = await draft.propose(ProposeCall("s", 0, history, TreeSpec(depth=3)))
            assert tree.tokens.tolist()[:1] == [3]  # prompt lookup continues 1 2 -> 3
            watch = health_pb2_grpc.HealthStub(draft.channel).Watch(
                health_pb2.HealthCheckRequest(service="")
            )
            assert (await watch.read()).status == SERVING
            proc.send_signal(signal.SIGTERM)
            assert (await watch.read()).status == NOT_SERVING
            watch.cancel()
        assert await asyncio.wait_for(proc.wait(), 60) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.parametrize("amx", [True, False])
async def test_a_bfloat16_worker_runs_the_kernel_on_every_thread_and_torch_on_one(tmp_path, amx):
    kernel = bf16_kernel(torch.bfloat16, torch.device("cpu"), tmp_path)
    if kernel is None:
        pytest.skip("the bfloat16 kernel does not build here")
    how = b"AMX tiles" if amx and kernel.amx else b"vector instructions"  # --no-amx: vector
    target = save_tiny_target(tmp_path / "target")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "workers.tools.cli", "worker", "target", "--model", str(target),
        "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
        "--insecure", "--health-port", "0", "--amx" if amx else "--no-amx",
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "2"}, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        said = []
        while b"serving" not in (line := await asyncio.wait_for(proc.stderr.readline(), 120)):
            assert line, f"the worker exited: {b''.join(said)!r}"
            said.append(line)
        assert any(b"bfloat16 kernel: " + how + b" on 2 threads" in x for x in said)
        assert any(b"torch on 1 thread beside the bfloat16 kernel's 2" in x for x in said)
        tasks = Path(f"/proc/{proc.pid}/task")
        names = [(task / "comm").read_text().strip() for task in tasks.iterdir()]
        assert names.count("specsplit-pool") == 1  # one helper beside the forward's thread
    finally:
        proc.kill()
        await proc.wait()


async def test_shutdown_finishes_in_flight_calls_then_refuses_new_ones():
    # a batching window far longer than the test: the call waits in the queue until shutdown
    async with target_worker(tiny_engine(seed=0), batch_wait_ms=600_000) as (server, target):
        start = asyncio.create_task(target.verify(START))
        while server.interceptor.gate.inflight == 0:  # until the call reached the worker
            await asyncio.sleep(0.01)
        await server.shutdown(grace_s=60, drain_s=0)
        assert len((await start).emitted) == 1  # run at once, not after the window
        check = await server.health.Check(health_pb2.HealthCheckRequest(service=""), None)
        assert check.status == NOT_SERVING
        stub = health_pb2_grpc.HealthStub(target.channel)
        try:
            await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            raise AssertionError("a stopped worker answered")
        except grpc.aio.AioRpcError as error:
            assert error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


async def test_info_and_metric_names():
    engine = tiny_engine(seed=0, slots=3)
    async with target_worker(engine, max_tree_nodes=12) as (server, target):
        await target.verify(START)
        info = await target.info()
        assert info.role == "target" and info.tokenizer_fingerprint == "vocab:96"
        assert (info.vocab_size, info.context_length, info.max_sessions) == (96, 256, 3)
        assert (info.live_sessions, info.max_tree_nodes) == (1, 12)
        assert info.lookup_rows == engine.cheap_rows  # the rows its steps' lookups may fill
        assert await target.health()
        metrics = scrape(server)
        for name in METRICS:
            samples = metrics.get(name) or metrics.get(f"{name}_count")
            assert samples, name
            assert all(labels["role"] == "target" for labels, _ in samples), name
        assert metrics["specsplit_worker_live_sessions"] == [({"role": "target"}, 1.0)]
        (tokens,) = [v for _, v in metrics["specsplit_worker_tokens_per_forward_sum"]]
        assert tokens == 3  # the prompt, fed once
        codes = {
            (labels["method"], labels["code"]): v
            for labels, v in metrics["specsplit_worker_requests_total"]
        }  # every method and known code from the start, so rate() sees the first error
        assert codes[("Verify", "OK")] == 1
        assert codes[("Verify", "NOT_FOUND")] == codes[("Verify", "UNAVAILABLE")] == 0
        assert metrics["specsplit_worker_evictions_total"] == [({"role": "target"}, 0.0)]


async def test_a_shared_prompt_prefix_is_counted_in_the_metrics_and_timings():
    prompt = list(range(3, 43))  # two full blocks of 16 are shared; the last token is fed again
    engine = tiny_engine(seed=0, slots=3)
    async with target_worker(engine) as (server, target):
        outcomes = [
            await target.verify(VerifyCall(sid, 0, prompt, TokenTree.empty(), SamplingParams()))
            for sid in ("a", "b")
        ]
        metrics = scrape(server)
    # the tokens each forward fed, which the gateway's cost fit divides its time by: the
    # second prompt's cached blocks cost nothing, and a prompt token fed without logits (all
    # but the last) counts its share of a token's work
    share = engine.model.prompt_token_share
    expected = [round(1 + 39 * share), round(1 + 7 * share)]
    assert [o.timings.batch_tokens for o in outcomes] == expected
    assert share < 1 and round(1 + 39 * share) < 40
    tokens = {labels["source"]: v for labels, v in metrics["specsplit_worker_prompt_tokens_total"]}
    assert tokens == {"sent": 80, "cached": 32}
    assert metrics["specsplit_worker_prefix_cache_tokens"] == [({"role": "target"}, 32.0)]


def test_a_worker_dies_with_its_parent():
    """--parent-pid (what `specsplit serve` passes its workers): the worker gets SIGTERM when
    its parent is SIGKILLed, and at once when its parent has already gone."""
    child = "import os, time; from workers.worker import die_with; die_with({}); time.sleep(60)"
    parent = subprocess.Popen(
        [sys.executable, "-c", "import os, subprocess, sys; "
         f"p = subprocess.Popen([sys.executable, '-c', {child!r}.format(os.getpid())]); "
         "print(p.pid, flush=True); p.wait()"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    worker = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    wait_until(lambda: not alive(worker), 120, "the worker to end with its parent")
    orphan = subprocess.run([sys.executable, "-c", child.format(parent.pid)], cwd=ROOT, timeout=60)
    assert orphan.returncode == -signal.SIGTERM


def test_the_event_loop_is_uvloop_where_installed_and_asyncio_where_not(monkeypatch):
    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run_loop(loop_module()).startswith("uvloop")
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as on a platform without it
    assert run_loop(loop_module()).startswith("asyncio")
