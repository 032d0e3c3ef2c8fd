"""Compares two py-spy raw profiles of the gateway: each function's samples on the event-loop
thread (not idle), the first profile against the second, largest difference first.

Usage: `python3 profile-compare.py AUTO.txt OFF.txt`.
"""

import collections
import sys

OURS = ("gateway/", "workers/", "grpc", "sse", "tokenizers", "pydantic", "prometheus", "json")


def load(path: str) -> tuple[collections.Counter, int]:
    """Samples per function (inclusive) of the event loop's busy stacks, and their total."""
    inclusive, total = collections.Counter(), 0
    for line in open(path):
        stack, _, count = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        if "main (gateway/serve.py" not in stack or frames[-1].startswith("run (uvloop"):
            continue  # another thread, or the loop waiting
        total += int(count)
        for frame in set(frames):
            if any(part in frame for part in OURS):
                inclusive[frame] += int(count)
    return inclusive, total


def main() -> None:
    auto, auto_total = load(sys.argv[1])
    off, off_total = load(sys.argv[2])
    print("active main-thread samples auto", auto_total, "off", off_total)
    for frame in sorted(set(auto) | set(off), key=lambda f: off[f] - auto[f])[:40]:
        print(f"{auto[frame]:6d} {off[frame]:6d} {auto[frame] - off[frame]:+6d} {frame[:130]}")


if __name__ == "__main__":
    main()
