"""Waves of N chat streams in the given modes, one serve: each wave's start and end time
(to match a scratch log in the gateway against the waves), tokens/s, tau, CPU ms a token.

Usage, from a clone of the commit measured: `PYTHONPATH=$PWD python waves.py STREAMS auto,off,...`.
"""

import asyncio
import sys
import time

from workers.tools.bench.paired import PairedBenchSettings, run_wave, serve_args
from workers.tools.bench.serving import ServeProcess
from workers.tools.bench.workloads import messages


async def waves(url: str, pid: int, streams: int, modes: list[str]) -> None:
    s = PairedBenchSettings(workload="chat", prompts=16, streams=str(streams))
    conversations = messages("chat", 16)
    for mode in modes:
        start = time.time()
        w = await run_wave(url, conversations, s, streams, mode, pid)
        cpu = [round(1000 * c / w.figures.tokens, 3) for c in w.cpu_s]
        tau = round(w.figures.tau or 1, 3)
        times = f"{start:.4f} {time.time():.4f}"
        print(mode, times, round(w.tok_s, 1), "tau", tau, "cpu/token", cpu)


def main() -> None:
    streams, modes = int(sys.argv[1]), sys.argv[2].split(",")
    s = PairedBenchSettings(workload="chat", prompts=16, streams=str(streams))
    with ServeProcess(serve_args(s, streams)) as serve:
        asyncio.run(waves(serve.url, serve.process.pid, streams, modes))


if __name__ == "__main__":
    main()
