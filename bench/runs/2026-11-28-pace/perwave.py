"""Each wave of a paired run at one point, with the target's round cost from /metrics after it.

Usage, from a clone of the commit measured: `PYTHONPATH=$PWD python perwave.py STREAMS
WORKLOAD PAIRS [serve args]`. Pair 0 is the bench's warm-up pair (left out of its table).
"""

import asyncio
import re
import sys

import httpx

from workers.tools.bench.paired import PairedBenchSettings, pair_order, run_wave, serve_args
from workers.tools.bench.serving import ServeProcess, run_streams
from workers.tools.bench.workloads import messages, warm_up

COST = re.compile(r'specsplit_target_round_cost_seconds\{[^}]*part="(\w+)"\} (\S+)')


async def waves(url: str, pid: int, s: PairedBenchSettings, streams: int, pairs: int) -> None:
    conversations = messages(s.workload, s.prompts)
    await run_streams(url, [warm_up(conversations)], 1, 1, 8, lambda text: 1)
    last: dict[str, float] = {}
    for pair in range(pairs + 1):
        for mode in pair_order(pair):
            w = await run_wave(url, conversations, s, streams, mode, pid)
            f, last[mode] = w.figures, w.tok_s
            second = mode == pair_order(pair)[1]
            ratio = f" ratio {last['auto'] / last['off']:.3f}" if second else ""
            text = httpx.get(url + "/metrics").text
            cost = {m[1]: round(1000 * float(m[2]), 2) for m in COST.finditer(text)}
            cpu = [round(1000 * c / f.tokens, 3) for c in w.cpu_s]
            print(
                f"{pair} {mode:4} {w.tok_s:6.1f} tau {f.tau or 0:.3f} "
                f"tpr {f.tokens_per_round or 0:.2f} acc {f.acceptance or 0:.2f} cpu {cpu}"
                f"{ratio} {cost}",
                flush=True,
            )


def main() -> None:
    streams, workload, pairs = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    s = PairedBenchSettings(
        workload=workload, streams=str(streams), prompts=16, serve_args=" ".join(sys.argv[4:])
    )
    with ServeProcess(serve_args(s, streams)) as serve:
        asyncio.run(waves(serve.url, serve.process.pid, s, streams, pairs))


if __name__ == "__main__":
    main()
