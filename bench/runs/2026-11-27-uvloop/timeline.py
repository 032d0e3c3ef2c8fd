"""Where the target waits between two forwards: per step of 8 calls (followed by another),
forward end E -> the worker's reply written -> read by the gateway -> the gateway's next
message written -> received by the worker -> the next step's start; medians by mode, ms.

Reads scratch logs (not committed; `perf_counter_ns` throughout): /tmp/s41/steps-*.txt
from the batcher (`wall start gap calls cost queue_max queue_min forward` a step),
/tmp/s41/wk-*.txt from the worker's stream handler (`M t calls`, `WR start end`),
/tmp/s41/gr-*.txt and gw-*.txt from the gateway's CallStream (`R t merged`, `W start end
calls`), and /tmp/s41/waves-gap2.txt (`waves.py` output, to tell the modes apart).
"""

import bisect
import glob
import statistics

NAMES = ("E->reply written", "->gateway read", "->gateway write", "->worker msg", "->next step")


def events(pattern: str, tag: str, column: int = 1) -> list[int]:
    found = []
    for path in glob.glob(pattern):
        for line in open(path):
            parts = line.split()
            if parts[0] == tag:
                found.append(int(parts[column]))
    return sorted(found)


def after(times: list[int], t: int) -> int | None:
    i = bisect.bisect_left(times, t)
    return times[i] if i < len(times) else None


def main() -> None:
    waves = [line.split() for line in open("/tmp/s41/waves-gap2.txt")]
    waves = [(w[0], float(w[1]), float(w[2])) for w in waves if w and w[0] in ("auto", "off")]
    steps = [line.split() for line in open(glob.glob("/tmp/s41/steps-*.txt")[0])]
    written = events("/tmp/s41/wk-*.txt", "WR", 2)
    read, sent = events("/tmp/s41/gr-*.txt", "R"), events("/tmp/s41/gw-*.txt", "W")
    received = events("/tmp/s41/wk-*.txt", "M")
    spans: dict[str, list[tuple[int, ...]]] = {}
    for step, following in zip(steps, steps[1:], strict=False):
        wall, start, calls, forward = float(step[0]), int(step[1]), step[3], int(step[7])
        nxt = int(following[1])
        mode = next((m for m, a, b in waves if a <= wall < b), None)
        if mode is None or calls != "8" or following[3] != "8":
            continue
        end = start + forward
        w1 = after(written, end)
        r = after(read, w1 or end)
        w = after(sent, r or end)
        m = after(received, w or end)
        if None in (w1, r, w, m) or not (end <= w1 <= r <= w <= m <= nxt):
            continue
        spans.setdefault(mode, []).append(
            (w1 - end, r - w1, w - r, m - w, nxt - m, nxt - end, forward)
        )
    for mode, rows in spans.items():
        columns = list(zip(*rows, strict=True))
        cells = [
            f"{n} {statistics.median(c) / 1e6:.2f}" for n, c in zip(NAMES, columns, strict=False)
        ]
        gap, forward = (statistics.median(c) / 1e6 for c in columns[5:])
        print(mode, len(rows), "  ".join(cells), f" gap total {gap:.2f}  forward {forward:.2f}")


if __name__ == "__main__":
    main()
