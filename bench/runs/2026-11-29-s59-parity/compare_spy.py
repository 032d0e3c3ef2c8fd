"""python compare_spy.py OUT TOKENS: py-spy raw files OUT/wave-K-MODE-PID.txt summed per mode;
each function's inclusive and own samples (100 Hz: 10 ms each), the default's less off's, in
µs a token over TOKENS tokens a mode."""

import glob
import sys
from collections import Counter

folder, tokens = sys.argv[1], int(sys.argv[2])


def load(mode: str) -> tuple[Counter, Counter, int]:
    inclusive, own, total = Counter(), Counter(), 0
    for path in glob.glob(f"{folder}/wave-*-{mode}-*.txt"):
        for line in open(path):
            stack, _, count = line.rstrip().rpartition(" ")
            if not stack:
                continue
            n = int(count)
            frames = stack.split(";")
            names = [f.split(" (")[0] + " " + f.split("/")[-1].rstrip(")") for f in frames]
            for name in set(names):
                inclusive[name] += n
            own[names[-1]] += n
            total += n
    return inclusive, own, total


off_in, off_own, off_total = load("off")
auto_in, auto_own, auto_total = load("auto")
scale = 10_000 / tokens  # µs a token per sample
print(
    f"samples: off {off_total} default {auto_total}; µs a token {off_total * scale:.1f} -> "
    f"{auto_total * scale:.1f}"
)
for title, a, o in (("inclusive", auto_in, off_in), ("own", auto_own, off_own)):
    print(f"\n{title}: µs a token, default - off (off, default)")
    rows = sorted(set(a) | set(o), key=lambda k: a[k] - o[k], reverse=True)
    for k in rows[:25]:
        print(f"{(a[k] - o[k]) * scale:7.1f} ({o[k] * scale:7.1f} {a[k] * scale:7.1f}) {k[:150]}")
    print("...")
    for k in rows[-8:]:
        print(f"{(a[k] - o[k]) * scale:7.1f} ({o[k] * scale:7.1f} {a[k] * scale:7.1f}) {k[:150]}")
