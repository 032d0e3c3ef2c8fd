"""The target worker's steps during default and off waves at N streams (one serve).

Usage, from a clone of the commit measured: `PYTHONPATH=$PWD python steps.py STREAMS PAIRS
[REQUESTS [WORKLOAD]]` (REQUESTS: each stream's requests a wave, at least; 2 unless given;
WORKLOAD: chat unless given).
"""

import asyncio
import re
import subprocess
import sys
import urllib.request

from workers.tools.bench.paired import PairedBenchSettings, run_wave, serve_args
from workers.tools.bench.serving import ServeProcess, children
from workers.tools.bench.workloads import messages

PREFIX = "specsplit_worker_"
NAMES = [
    "batch_size_count",
    "batch_size_sum",
    "forward_seconds_sum",
    "queue_seconds_sum",
    "queue_seconds_count",
    "tokens_per_forward_sum",
]


def metrics_ports(pid: int) -> list[int]:
    """The listening ports of the serve's children (its workers' gRPC and metrics ports)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    kids = set(children(pid))
    ports = []
    for line in out.splitlines():
        m = re.search(r":(\d+)\s.*pid=(\d+)", line)
        if m and int(m.group(2)) in kids:
            ports.append(int(m.group(1)))
    return ports


def scrape(ports: list[int]) -> dict[str, float] | None:
    """The target worker's counters."""
    for port in ports:
        try:
            url = f"http://127.0.0.1:{port}/metrics"
            text = urllib.request.urlopen(url, timeout=2).read().decode()
        except Exception:  # noqa: BLE001 - a gRPC port
            continue
        if 'role="target"' in text and PREFIX + "batch_size_count" in text:
            found = {}
            for n in NAMES:
                values = re.findall(rf'^{PREFIX}{n}{{role="target"}} (\S+)$', text, re.M)
                found[n] = sum(float(v) for v in values)
            return found
    return None


async def waves(url: str, pid: int, s: PairedBenchSettings, pairs: int) -> None:
    streams = int(s.streams)
    conversations = messages(s.workload, 16)
    await run_wave(url, conversations, s, streams, "auto", None)
    await run_wave(url, conversations, s, streams, "off", None)
    ports = metrics_ports(pid)
    for mode in ["auto", "off", "off", "auto"] * pairs:
        before = scrape(ports)
        w = await run_wave(url, conversations, s, streams, mode, pid)
        after = scrape(ports)
        d = {k: after[k] - before[k] for k in before}
        steps = d["batch_size_count"]
        queued = d["queue_seconds_sum"] / max(1, d["queue_seconds_count"])
        cpu = [round(1000 * c / w.figures.tokens, 3) for c in w.cpu_s]
        print(
            f"{mode:4} {w.tok_s:6.1f} tau {w.figures.tau or 1:.3f} wall {w.figures.wall_s:5.2f} "
            f"steps {steps:4.0f} calls/step {d['batch_size_sum'] / steps:5.2f} "
            f"tokens/step {d['tokens_per_forward_sum'] / steps:5.2f} "
            f"forward ms {1000 * d['forward_seconds_sum'] / steps:5.2f} "
            f"busy {d['forward_seconds_sum']:5.2f} s queue ms {1000 * queued:5.2f} cpu/token {cpu}",
            flush=True,
        )


def main() -> None:
    streams, pairs = int(sys.argv[1]), int(sys.argv[2])
    requests = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    workload = sys.argv[4] if len(sys.argv) > 4 else "chat"
    s = PairedBenchSettings(
        workload=workload, prompts=16, streams=str(streams), requests_per_stream=requests
    )
    with ServeProcess(serve_args(s, streams)) as serve:
        asyncio.run(waves(serve.url, serve.process.pid, s, pairs))


if __name__ == "__main__":
    main()
