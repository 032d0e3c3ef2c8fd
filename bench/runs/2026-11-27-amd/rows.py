"""What a draft node costs the target beside 8 or 16 decode rows on a CPU without AMX: one
forward of N decode rows behind 300 cached tokens (`forward`), and the target runner's
verify of 8 or 16 sessions with a few draft nodes beside them (`runner`); the measurements
are ../2026-11-27-blocks/blocks.py's, at other sizes. Lower quartiles of interleaved repeats.

Usage, from a clone of the commit measured: `PYTHONPATH=$PWD python rows.py forward|runner`.
The runner's two sizes were measured in separate processes (`runner 8`, `runner 16`): a
second engine in one process runs beside the first one's kernel threads.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "2026-11-27-blocks"))

import blocks  # noqa: E402

ROWS = (1, 2, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14, 16, 17, 18, 20, 24)


def main() -> None:
    if sys.argv[1] == "forward":
        blocks.forward(24, ROWS)
    else:
        blocks.runner(int(sys.argv[2]), {"1 with 4 nodes": [4]})


if __name__ == "__main__":
    main()
