"""py-spy the gateway (the serve's main process), or its target worker, during waves of one
mode at N chat streams.

Usage, from a clone of the commit measured:
`PYTHONPATH=$PWD python prof.py STREAMS MODE WAVES OUT [native] [target]` (MODE: auto or off;
OUT: py-spy's raw stacks). Needs py-spy on PATH; `native` records C frames too (blocking the
process, slower); `target` records the serve's target worker instead of the gateway.
"""

import asyncio
import subprocess
import sys
from pathlib import Path

from workers.tools.bench.paired import PairedBenchSettings, run_wave, serve_args
from workers.tools.bench.serving import ServeProcess, children
from workers.tools.bench.workloads import messages


def target_pid(serve_pid: int) -> int:
    """The serve's target worker."""
    for child in children(serve_pid):
        if "worker target" in Path(f"/proc/{child}/cmdline").read_text().replace("\0", " "):
            return child
    raise RuntimeError("no target worker")


async def waves(
    url: str, pid: int, streams: int, mode: str, n: int, out: str, native: bool, target: bool
):
    s = PairedBenchSettings(workload="chat", prompts=16, streams=str(streams))
    conversations = messages("chat", 16)
    for warm in ("auto", "off"):
        await run_wave(url, conversations, s, streams, warm, None)
    how = ["--native"] if native else ["--nonblocking"]
    spied = target_pid(pid) if target else pid
    command = ["py-spy", "record", "-p", str(spied), "-r", "250", "-f", "raw", "-o", out, *how]
    spy = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    await asyncio.sleep(1)
    tokens = 0
    for _ in range(n):
        w = await run_wave(url, conversations, s, streams, mode, pid)
        tokens += w.figures.tokens
        cpu = [round(1000 * c / w.figures.tokens, 3) for c in w.cpu_s]
        print(mode, round(w.tok_s, 1), "tau", w.figures.tau, "cpu/token", cpu, flush=True)
    spy.send_signal(2)
    spy.wait()
    print("tokens", tokens)


def main() -> None:
    streams, mode, n, out = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    native, target = "native" in sys.argv[5:], "target" in sys.argv[5:]
    s = PairedBenchSettings(workload="chat", prompts=16, streams=str(streams))
    with ServeProcess(serve_args(s, streams)) as serve:
        asyncio.run(waves(serve.url, serve.process.pid, streams, mode, n, out, native, target))


if __name__ == "__main__":
    main()
