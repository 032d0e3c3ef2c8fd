"""8 chat streams, paired waves (six pairs): each mode's median TTFT, ITL p50 and tokens/s, and the pairs' ratios (a diagnostic; run from a clone with PYTHONPATH=.)."""
import asyncio, statistics
from workers.tools.bench.paired import PairedBenchSettings, serve_args, run_point
from workers.tools.bench.serving import ServeProcess

s = PairedBenchSettings(workload="chat", prompts=16, requests_per_stream=8, pairs=6)
with ServeProcess(serve_args(s, 8)) as serve:
    point = asyncio.run(run_point(serve.url, s, 8, serve.process.pid))
for mode in ("auto", "off"):
    waves = point.of(mode)
    f = [w.figures for w in waves]
    print(mode, "tok/s", round(statistics.median(x.tok_s_total for x in f), 1),
          "ttft p50 ms", round(statistics.median(x.ttft_p50_ms for x in f), 1),
          "itl p50 ms", round(statistics.median(x.itl_p50_ms for x in f), 2),
          "tokens", sum(x.tokens for x in f), "requests", sum(x.requests for x in f),
          "busy_s", round(sum(x.busy_s for x in f), 1))
print("ratios", [round(r, 3) for r in point.ratios()])
