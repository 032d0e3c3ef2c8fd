"""Waves of one fresh serve in a given order of modes.

Usage, from a clone of the commit measured: `PYTHONPATH=$PWD python seqwave.py STREAMS
WORKLOAD MODE,MODE,... [serve args]` (MODE: auto or off).
"""

import asyncio
import sys

from workers.tools.bench.paired import PairedBenchSettings, run_wave, serve_args
from workers.tools.bench.serving import ServeProcess, run_streams
from workers.tools.bench.workloads import messages, warm_up


async def waves(url: str, pid: int, s: PairedBenchSettings, streams: int, order: list[str]):
    conversations = messages(s.workload, s.prompts)
    await run_streams(url, [warm_up(conversations)], 1, 1, 8, lambda text: 1)
    for i, mode in enumerate(order):
        w = await run_wave(url, conversations, s, streams, mode, pid)
        f = w.figures
        cpu = [round(1000 * c / f.tokens, 3) for c in w.cpu_s]
        print(
            f"{i} {mode:4} {w.tok_s:6.1f} tau {f.tau or 0:.3f} "
            f"tpr {f.tokens_per_round or 0:.2f} acc {f.acceptance or 0:.2f} cpu {cpu}",
            flush=True,
        )


def main() -> None:
    streams, workload, order = int(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
    s = PairedBenchSettings(
        workload=workload, streams=str(streams), prompts=16, serve_args=" ".join(sys.argv[4:])
    )
    with ServeProcess(serve_args(s, streams)) as serve:
        asyncio.run(waves(serve.url, serve.process.pid, s, streams, order))


if __name__ == "__main__":
    main()
