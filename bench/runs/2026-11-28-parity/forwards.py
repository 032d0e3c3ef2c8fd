"""Per wave at N streams, auto vs off: the target worker's forwards, the tokens they fed and
their seconds (its /metrics), and the gateway's counters, to see where the default's cost
lies. Run from the repository root: python bench/runs/2026-11-28-parity/forwards.py 8 chat 6"""

import asyncio
import json
import subprocess
import sys
import urllib.request

from workers.tools.bench.paired import PairedBenchSettings, pair_order, run_wave, serve_args
from workers.tools.bench.serving import ServeProcess, children, run_streams
from workers.tools.bench.workloads import messages, warm_up

WORKER = "specsplit_worker_"


def scrape(url: str) -> dict[str, float]:
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


def worker_metrics_url(pid: int) -> str | None:
    """The /metrics of worker `pid`, found among its listening ports."""
    listening = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    for line in listening.splitlines():
        if f"pid={pid}," not in line:
            continue
        url = f"http://127.0.0.1:{line.split()[3].rsplit(':', 1)[1]}/metrics"
        try:
            text = urllib.request.urlopen(url, timeout=2).read().decode()
            if WORKER + "tokens_per_forward" in text:
                return url
        except OSError:
            pass
    return None


def delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: b[k] - a.get(k, 0.0) for k in b if b[k] != a.get(k, 0.0)}


def summed(deltas: list[dict[str, float]], prefix: str) -> float:
    return sum(v for d in deltas for k, v in d.items() if k.startswith(prefix))


async def main(url: str, pid: int, s: PairedBenchSettings, streams: int, pairs: int) -> list:
    workers = [u for u in map(worker_metrics_url, children(pid)) if u]
    print("worker metrics", workers, flush=True)
    conversations = messages(s.workload, s.prompts)
    await run_streams(url, [warm_up(conversations)], 1, 1, 8, lambda text: 1)
    for mode in ("auto", "off"):
        await run_wave(url, conversations, s, streams, mode, pid)
    rows = []
    for pair in range(pairs):
        for mode in pair_order(pair):
            before = [scrape(u) for u in [*workers, url + "/metrics"]]
            wave = await run_wave(url, conversations, s, streams, mode, pid)
            after = [scrape(u) for u in [*workers, url + "/metrics"]]
            deltas = [delta(a, b) for a, b in zip(before, after, strict=True)]
            f = wave.figures
            rows.append(
                dict(pair=pair, mode=mode, tok_s=f.tok_s_total, tokens=f.tokens, wall=f.wall_s)
                | dict(cpu=wave.cpu_s, deltas=deltas)
            )
            forwards = summed(deltas[:-1], WORKER + "tokens_per_forward_count")
            fed = summed(deltas[:-1], WORKER + "tokens_per_forward_sum")
            seconds = summed(deltas[:-1], WORKER + "forward_seconds_sum")
            batches = summed(deltas[:-1], WORKER + "batch_size_count")
            per = max(forwards, 1)
            print(
                f"{pair} {mode:4} tok/s {f.tok_s_total:6.1f} tokens {f.tokens} "
                f"forwards {forwards:.0f} fed {fed:.0f} fed/fwd {fed / per:.2f} "
                f"fwd ms {1000 * seconds / per:.2f} "
                f"fwd s/token(ms) {1000 * seconds / max(f.tokens, 1):.3f} "
                f"batches {batches:.0f} cpu {[round(c, 2) for c in wave.cpu_s]}",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    streams, workload, pairs = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    settings = PairedBenchSettings(workload=workload, prompts=16, requests_per_stream=8)
    with ServeProcess(serve_args(settings, streams)) as serve:
        rows = asyncio.run(main(serve.url, serve.process.pid, settings, streams, pairs))
    with open(f"/tmp/s50/forwards-{workload}-{streams}.json", "w") as out:
        json.dump(rows, out)
