"""`python count_pairs.py` from bench/runs: at the points where the default drafts next to
nothing (8, 16 and 32 chat streams, 32 grounded), the pairs the default was ahead in, over
every twelve-pair sweep's `sweep-chat.md` / `sweep-grounded.md`, and the chance of so few
or fewer were each pair a coin's toss."""

import glob
import re
from math import comb

POINTS = {("chat", 8), ("chat", 16), ("chat", 32), ("grounded", 32)}


def at_most(k: int, n: int) -> float:
    return sum(comb(n, i) for i in range(k + 1)) / 2**n


counts: dict[tuple[str, int], list[int]] = {}
for path in sorted(glob.glob("*/sweep-chat.md") + glob.glob("*/sweep-grounded.md")):
    workload = "chat" if path.endswith("chat.md") else "grounded"
    for line in open(path):
        ahead = re.search(r"\| (\d+) of 12 \|", line)
        if line.startswith("| ") and ahead:
            streams = int(line.strip("| ").split("|")[0])
            if (workload, streams) in POINTS:
                counts.setdefault((workload, streams), []).append(int(ahead.group(1)))
total = pairs = 0
for point, aheads in sorted(counts.items()):
    total, pairs = total + sum(aheads), pairs + 12 * len(aheads)
    chance = at_most(sum(aheads), 12 * len(aheads))
    print(point, f"{sum(aheads)} of {12 * len(aheads)}", aheads, f"chance {chance:.3f}")
print("all", f"{total} of {pairs}", f"chance {at_most(total, pairs):.3f}")
