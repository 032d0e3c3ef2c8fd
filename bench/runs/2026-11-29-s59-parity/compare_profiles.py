"""`python compare_profiles.py OUT TOKENS`: the functions whose own time (cProfile's tottime)
the default's waves (profile-1, -3, -5) spent beyond speculation off's (profile-0, -2, -4),
in µs a token over TOKENS tokens a mode; the 40 largest, then the 10 most negative."""

import pstats
import sys
from collections import defaultdict

folder, tokens = sys.argv[1], int(sys.argv[2])


def load(waves: list[int]) -> dict[str, list[float]]:
    """function -> [own seconds, cumulative seconds, calls], summed over the waves"""
    total: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for k in waves:
        for func, (_, calls, own, cumulative, _) in pstats.Stats(
            f"{folder}/profile-{k}.prof"
        ).stats.items():
            name = f"{func[0].split('/')[-1]}:{func[1]}:{func[2]}"
            total[name][0] += own
            total[name][1] += cumulative
            total[name][2] += calls
    return total


off, auto = load([0, 2, 4]), load([1, 3, 5])
none = [0.0, 0.0, 0]
rows = sorted(
    ((auto.get(k, none)[0] - off.get(k, none)[0], k) for k in set(off) | set(auto)),
    reverse=True,
)
print(f"own seconds in all: off {sum(v[0] for v in off.values()):.3f}", end=" ")
print(f"default {sum(v[0] for v in auto.values()):.3f}")
print("µs a token more | calls off, default | own s off, default | cumulative s | function")
for diff, k in rows[:40] + [(0.0, "...")] + rows[-10:]:
    if k == "...":
        print(k)
        continue
    o, a = off.get(k, none), auto.get(k, none)
    print(
        f"{1e6 * diff / tokens:7.2f} | {o[2]:8d} {a[2]:8d} | {o[0]:6.3f} {a[0]:6.3f} |"
        f" {o[1]:6.3f} {a[1]:6.3f} | {k}"
    )
