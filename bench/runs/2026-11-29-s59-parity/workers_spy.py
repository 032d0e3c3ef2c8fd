"""py-spy on the serve's workers over waves of one mode at a time:
python workers_spy.py WORKLOAD STREAMS WAVES OUT (from the repository root). Waves alternate
off and the default after a warm-up wave of each; py-spy records every worker (the serve's
children, all threads, 100 Hz, --nonblocking) for each wave into OUT/wave-K-PID.txt (raw,
collapsed stacks), and each wave prints its tokens and CPU a token."""

import asyncio
import os
import subprocess
import sys
import time

from workers.tools.bench.paired import MODES, PairedBenchSettings, serve_args, serve_cpu
from workers.tools.bench.serving import ServeProcess, children, run_streams
from workers.tools.bench.workloads import messages, warm_up

SPY = "/tmp/pyspy-bin/bin/py-spy"  # py-spy 0.4.3, pip-installed there (not a project dependency)
workload, streams, waves, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
os.makedirs(out, exist_ok=True)


async def main(url: str, pid: int) -> None:
    conversations = messages(workload, 16)
    await run_streams(url, [warm_up(conversations)], 1, 1, 8, lambda text: 1)
    for mode in ("off", "auto"):
        await run_streams(url, conversations, streams, 8, 64, lambda t: 1, MODES[mode])
    for k in range(waves):
        mode = ("off", "auto")[k % 2]
        spies = [
            subprocess.Popen(
                [
                    SPY,
                    "record",
                    "-p",
                    str(child),
                    "-r",
                    "100",
                    "--nonblocking",
                    "-f",
                    "raw",
                    "-o",
                    f"{out}/wave-{k}-{mode}-{child}.txt",
                    "-d",
                    "600",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for child in children(pid)
        ]
        time.sleep(1.0)
        before = serve_cpu(pid)
        timed, wall = await run_streams(
            url, conversations, streams, 8, 64, lambda t: 1, MODES[mode]
        )
        after = serve_cpu(pid)
        for spy in spies:
            spy.send_signal(2)
            spy.wait()
        tokens = sum(t.tokens for t in timed)
        gw, wk = (b - a for a, b in zip(before, after, strict=True))
        print(
            f"wave {k} {mode} tokens={tokens} tok/s={tokens / wall:.1f} "
            f"gw_ms_tok={1000 * gw / tokens:.3f} wk_ms_tok={1000 * wk / tokens:.3f}",
            flush=True,
        )


with ServeProcess(serve_args(PairedBenchSettings(), streams)) as serve:
    asyncio.run(main(serve.url, serve.process.pid))
