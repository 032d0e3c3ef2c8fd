"""Waves taking turns at 16 chat streams, each wave's start and end printed (perf_counter ns),
to split a log of the target's batch steps by wave. The step log came from a line the
target's Batcher appended per step in a scratch copy (not committed): the step's start, its
end, its calls, their tokens, the spread of their arrivals, the last arrival to the start,
and the engine's idle gap before it.

Usage, from that copy: `PYTHONPATH=$PWD python split.py > split.out`.
"""

import asyncio
import time

from workers.tools.bench.paired import PairedBenchSettings, run_wave, serve_args
from workers.tools.bench.serving import ServeProcess
from workers.tools.bench.workloads import messages

STREAMS = 16


async def waves(url: str) -> None:
    s = PairedBenchSettings(
        workload="chat", prompts=16, streams=str(STREAMS), requests_per_stream=3
    )
    conversations = messages("chat", 16)
    await run_wave(url, conversations, s, STREAMS, "auto", None)
    await run_wave(url, conversations, s, STREAMS, "off", None)
    for mode in ["auto", "off", "off", "auto", "auto", "off"]:
        start = time.perf_counter_ns()
        w = await run_wave(url, conversations, s, STREAMS, mode, None)
        print(mode, start, time.perf_counter_ns(), round(w.tok_s, 1), w.figures.tau, flush=True)


def main() -> None:
    s = PairedBenchSettings(workload="chat", prompts=16, streams=str(STREAMS))
    with ServeProcess(serve_args(s, STREAMS)) as serve:
        asyncio.run(waves(serve.url))


if __name__ == "__main__":
    main()
