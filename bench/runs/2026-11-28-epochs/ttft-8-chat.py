"""8 chat streams, paired waves (six pairs): each mode's median TTFT, ITL p50 and tokens/s,
and the pairs' ratios (a diagnostic; run from a clone with PYTHONPATH=.)."""

import asyncio
import statistics

from workers.tools.bench.paired import PairedBenchSettings, run_point, serve_args
from workers.tools.bench.serving import ServeProcess

s = PairedBenchSettings(workload="chat", prompts=16, requests_per_stream=8, pairs=6)
with ServeProcess(serve_args(s, 8)) as serve:
    point = asyncio.run(run_point(serve.url, s, 8, serve.process.pid))
for mode in ("auto", "off"):
    figures = [wave.figures for wave in point.of(mode)]
    print(
        mode,
        "tok/s",
        round(statistics.median(f.tok_s_total for f in figures), 1),
        "ttft p50 ms",
        round(statistics.median(f.ttft_p50_ms for f in figures), 1),
        "itl p50 ms",
        round(statistics.median(f.itl_p50_ms for f in figures), 2),
        "tokens",
        sum(f.tokens for f in figures),
        "requests",
        sum(f.requests for f in figures),
        "busy_s",
        round(sum(f.busy_s for f in figures), 1),
    )
print("ratios", [round(r, 3) for r in point.ratios()])
