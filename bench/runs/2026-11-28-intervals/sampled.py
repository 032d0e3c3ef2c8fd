"""Paired waves of sampled requests (the default against speculation off, taking turns).

Usage, from a clone of the commit measured: `PYTHONPATH=$PWD python sampled.py STREAMS
WORKLOAD PAIRS TEMPERATURE [serve args]`. Pair 0 warms the serve up and is left out.
"""

import asyncio
import math
import statistics
import sys

from workers.tools.bench.measure import Figures
from workers.tools.bench.paired import (
    MODES,
    PairedBenchSettings,
    median_interval,
    pair_order,
    serve_args,
)
from workers.tools.bench.serving import ServeProcess, run_streams
from workers.tools.bench.workloads import messages, warm_up


async def waves(url: str, s: PairedBenchSettings, streams: int, pairs: int, temperature: float):
    conversations = messages(s.workload, s.prompts)
    await run_streams(url, [warm_up(conversations)], 1, 1, 8, lambda text: 1)
    per_stream = max(s.requests_per_stream, math.ceil(len(conversations) / streams))
    ratios, last = [], {}
    for pair in range(pairs + 1):
        for mode in pair_order(pair):
            extra = {"temperature": temperature, "top_p": 1.0, **(MODES[mode] or {})}
            timed, wall = await run_streams(
                url, conversations, streams, per_stream, s.max_tokens, lambda text: 1, extra
            )
            f = Figures.of(timed, wall)
            last[mode] = f.tok_s_total
            print(f"{pair} {mode:4} {f.tok_s_total:6.1f} tau {f.tau or 0:.3f}", flush=True)
        if pair:
            ratios.append(last["auto"] / last["off"])
    print(
        f"median {statistics.median(ratios):.3f} range {min(ratios):.2f}-{max(ratios):.2f} "
        f"interval {median_interval(ratios)} ahead {sum(r > 1 for r in ratios)} of {len(ratios)}"
    )


def main() -> None:
    streams, workload, pairs = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    temperature = float(sys.argv[4])
    s = PairedBenchSettings(
        workload=workload, streams=str(streams), prompts=16, serve_args=" ".join(sys.argv[5:])
    )
    with ServeProcess(serve_args(s, streams)) as serve:
        asyncio.run(waves(serve.url, s, streams, pairs, temperature))


if __name__ == "__main__":
    main()
