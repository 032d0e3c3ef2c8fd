"""The gateway's round phases (its `specsplit_round_phase_seconds` histogram) around waves of
16 chat streams taking turns between the default and off: mean seconds a round of the draft
phase (lookup and policy), the verify call, and the gateway's turn between rounds.

Usage, from a clone of the commit measured: `PYTHONPATH=$PWD python phase.py`.
"""

import asyncio
import re
import urllib.request

from workers.tools.bench.paired import PairedBenchSettings, run_wave, serve_args
from workers.tools.bench.serving import ServeProcess
from workers.tools.bench.workloads import messages

NAME = "specsplit_round_phase_seconds"


def phases(url: str) -> dict[str, tuple[float, float]]:
    """Each phase's (sum of seconds, rounds) so far."""
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    out = {}
    for phase in ("draft", "verify", "gateway"):
        total = re.search(rf'{NAME}_sum{{phase="{phase}"}} (\S+)', text).group(1)
        count = re.search(rf'{NAME}_count{{phase="{phase}"}} (\S+)', text).group(1)
        out[phase] = (float(total), float(count))
    return out


async def waves(url: str, pid: int) -> None:
    s = PairedBenchSettings(workload="chat", prompts=16, streams="16")
    conversations = messages("chat", 16)
    for mode in ["auto", "off"] * 3:
        before = phases(url)
        w = await run_wave(url, conversations, s, 16, mode, pid)
        after = phases(url)
        cells = []
        for phase, (total, count) in after.items():
            seconds, rounds = total - before[phase][0], count - before[phase][1]
            cells.append(f"{phase} {1e6 * seconds / max(1, rounds):.1f}us x{rounds:.0f}")
        print(mode, round(w.tok_s, 1), " ".join(cells), flush=True)


def main() -> None:
    s = PairedBenchSettings(workload="chat", prompts=16, streams="16")
    with ServeProcess(serve_args(s, 16)) as serve:
        asyncio.run(waves(serve.url, serve.process.pid))


if __name__ == "__main__":
    main()
