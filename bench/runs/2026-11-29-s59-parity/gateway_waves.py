"""The gateway's CPU a token, and optionally its profile, over waves of one mode at a time.

From the repository root: `PYTHONPATH=DIR python gateway_waves.py WORKLOAD STREAMS WAVES OUT`
where DIR holds `profile_toggle.py` copied as `sitecustomize.py`; `PROFILE=0` leaves the
profiler out (the CPU figures then are the serve's own). One serve of `make run`'s defaults
(as `specsplit bench paired` starts it), a warm-up wave of each mode, then WAVES waves
alternating speculation off and the default, 8 requests a stream, 64 tokens a request. Each
wave prints its tokens a second and the gateway's and the workers' CPU milliseconds a token
(/proc); with the profiler each wave's profile is OUT/profile-K.prof.
"""

import asyncio
import os
import signal
import sys
import time

from workers.tools.bench.paired import MODES, PairedBenchSettings, serve_args, serve_cpu
from workers.tools.bench.serving import ServeProcess, run_streams
from workers.tools.bench.workloads import messages, warm_up

workload, streams, waves, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
os.makedirs(out, exist_ok=True)
profiling = os.environ.get("PROFILE", "1") == "1"
env = dict(os.environ, SPECSPLIT_GW_PROFILE=out) if profiling else dict(os.environ)


async def main(url: str, pid: int) -> None:
    conversations = messages(workload, 16)
    await run_streams(url, [warm_up(conversations)], 1, 1, 8, lambda text: 1)
    for mode in ("off", "auto"):  # a warm-up wave of each, not profiled
        await run_streams(url, conversations, streams, 8, 64, lambda t: 1, MODES[mode])
    for k in range(waves):
        mode = ("off", "auto")[k % 2]
        if profiling:
            os.kill(pid, signal.SIGUSR1)
        before = serve_cpu(pid)
        body = MODES[mode]
        timed, wall = await run_streams(url, conversations, streams, 8, 64, lambda t: 1, body)
        after = serve_cpu(pid)
        if profiling:
            os.kill(pid, signal.SIGUSR1)
        tokens = sum(t.tokens for t in timed)
        gateway, workers = (b - a for a, b in zip(before, after, strict=True))
        print(
            f"wave {k} {mode} tokens={tokens} tok/s={tokens / wall:.1f} "
            f"gw_ms_tok={1000 * gateway / tokens:.3f} wk_ms_tok={1000 * workers / tokens:.3f}",
            flush=True,
        )
        time.sleep(1.0)


with ServeProcess(serve_args(PairedBenchSettings(), streams), env) as serve:
    asyncio.run(main(serve.url, serve.process.pid))
