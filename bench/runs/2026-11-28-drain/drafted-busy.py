"""Each wave of a paired run with the draft tokens its requests' `speculation_stats` count,
and where its time went: the share of the streams' time in requests (busy), a request's
milliseconds a token (the requests' seconds over their tokens), and the wave's drain (tail:
the seconds from the last request's start to the wave's end).

bench/runs/2026-11-28-intervals/drafted.py with those three columns. Usage, from a clone
of the commit measured: `PYTHONPATH=$PWD python drafted-busy.py STREAMS WORKLOAD PAIRS
TEMPERATURE`. Pair 0 is the bench's warm-up pair.
"""

import asyncio
import math
import sys

from workers.tools.bench.measure import Figures
from workers.tools.bench.paired import (
    MODES,
    PairedBenchSettings,
    pair_order,
    serve_args,
    serve_cpu,
)
from workers.tools.bench.serving import ServeProcess, run_streams
from workers.tools.bench.workloads import messages, warm_up


def total(timed: list, key: str) -> int:
    """A `speculation_stats` count summed over the requests."""
    return sum(t.stats.get(key, 0) for t in timed if t.stats)


async def waves(url: str, pid: int, s: PairedBenchSettings, streams: int, pairs: int) -> None:
    conversations = messages(s.workload, s.prompts)
    await run_streams(url, [warm_up(conversations)], 1, 1, 8, lambda text: 1)
    per_stream = max(s.requests_per_stream, math.ceil(len(conversations) / streams))
    for pair in range(pairs + 1):
        for mode in pair_order(pair):
            extra = {**(MODES[mode] or {}), "temperature": s.temperature}
            before = serve_cpu(pid)
            timed, wall = await run_streams(
                url, conversations, streams, per_stream, s.max_tokens, lambda text: 1, extra
            )
            workers_s = serve_cpu(pid)[1] - before[1]
            f = Figures.of(timed, wall)
            drafted, accepted = total(timed, "draft_tokens"), total(timed, "accepted_tokens")
            busy = sum(t.seconds for t in timed)
            tail = wall - (max(t.start for t in timed) - min(t.start for t in timed))
            print(
                f"{pair} {mode:4} {f.tok_s_total:6.1f} tau {f.tau or 0:.3f} "
                f"tpr {f.tokens_per_round or 0:.2f} rounds {total(timed, 'rounds')} "
                f"steps {total(timed, 'verify_steps')} drafted {drafted} "
                f"accepted {accepted} tokens {f.tokens} "
                f"wcpu/tok {1000 * workers_s / f.tokens:.3f} busy {busy / (streams * wall):.2f} "
                f"ms/tok/session {1000 * busy / f.tokens:.1f} tail {tail:.2f} wall {wall:.2f}",
                flush=True,
            )


def main() -> None:
    streams, workload, pairs = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    s = PairedBenchSettings(
        workload=workload, streams=str(streams), prompts=16, temperature=float(sys.argv[4])
    )
    with ServeProcess(serve_args(s, streams)) as serve:
        asyncio.run(waves(serve.url, serve.process.pid, s, streams, pairs))


if __name__ == "__main__":
    main()
