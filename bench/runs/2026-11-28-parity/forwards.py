"""Per wave at N chat streams, auto vs off: the target worker's forwards, rows and seconds
(its /metrics), and the gateway's counters, to see where the default's cost lies."""
import asyncio, json, re, subprocess, sys, urllib.request
from workers.tools.bench.paired import PairedBenchSettings, serve_args, run_wave, pair_order
from workers.tools.bench.serving import ServeProcess, run_streams, children
from workers.tools.bench.workloads import messages, warm_up

streams, workload, pairs = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
s = PairedBenchSettings(workload=workload, prompts=16, requests_per_stream=8)

def scrape(url):
    out = {}
    for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            pass
    return out

def worker_metrics_url(pid):
    ss = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    for line in ss.splitlines():
        if f"pid={pid}," in line:
            port = line.split()[3].rsplit(":", 1)[1]
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
                if "specsplit_worker_tokens_per_forward" in text:
                    return f"http://127.0.0.1:{port}/metrics"
            except Exception:
                pass
    raise SystemExit("no worker metrics port")

def delta(a, b):
    return {k: b[k] - a.get(k, 0.0) for k in b if b[k] != a.get(k, 0.0)}

async def main(url, pid):
    kids = children(pid)
    murls = []
    for k in kids:
        try:
            murls.append(worker_metrics_url(k))
        except SystemExit:
            pass
    print("worker metrics", murls, flush=True)
    conv = messages(s.workload, s.prompts)
    await run_streams(url, [warm_up(conv)], 1, 1, 8, lambda t: 1)
    for mode in ("auto", "off"):
        await run_wave(url, conv, s, streams, mode, pid)
    rows = []
    for pair in range(pairs):
        for mode in pair_order(pair):
            before = [scrape(u) for u in murls] + [scrape(url + "/metrics")]
            w = await run_wave(url, conv, s, streams, mode, pid)
            after = [scrape(u) for u in murls] + [scrape(url + "/metrics")]
            d = [delta(a, b) for a, b in zip(before, after)]
            rows.append({"pair": pair, "mode": mode, "tok_s": w.figures.tok_s_total, "tokens": w.figures.tokens,
                         "wall": w.figures.wall_s, "cpu": w.cpu_s, "deltas": d})
            wk = {}
            for dd in d[:-1]:
                for k, v in dd.items():
                    wk[k] = wk.get(k, 0) + v
            def g(prefix):
                return sum(v for k, v in wk.items() if k.startswith(prefix))
            fwd = g("specsplit_worker_tokens_per_forward_count")
            fed = g("specsplit_worker_tokens_per_forward_sum")
            fsec = g("specsplit_worker_forward_seconds_sum")
            bat = g("specsplit_worker_batch_size_count")
            print(f"{pair} {mode:4} tok/s {w.figures.tok_s_total:6.1f} tokens {w.figures.tokens} forwards {fwd:.0f} "
                  f"fed {fed:.0f} fed/fwd {fed/max(fwd,1):.2f} fwd ms {1000*fsec/max(fwd,1):.2f} fwd s/token(ms) {1000*fsec/max(w.figures.tokens,1):.3f} "
                  f"batches {bat:.0f} cpu {[round(c,2) for c in w.cpu_s]}", flush=True)
    json.dump(rows, open(f"/tmp/s50/forwards-{workload}-{streams}.json", "w"))

with ServeProcess(serve_args(s, streams)) as serve:
    asyncio.run(main(serve.url, serve.process.pid))
