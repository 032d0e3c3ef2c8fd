"""The bfloat16 kernel's products alone at a list of row counts: lower quartile of 40
interleaved calls, µs, for the embedded model's layer shapes.

Usage, from a clone of the commit measured: `PYTHONPATH=$PWD python lin.py [ROWS,ROWS,...]`.
"""

import sys
import time

import torch

from workers.engine.bf16_linear import bf16_kernel
from workers.engine.loader import default_cache_dir

ROWS = (1, 4, 6, 7, 8, 9, 10, 11, 12, 13, 16, 17, 18, 24)
SHAPES = {  # name: (K, N)
    "gate_up": (576, 3072),
    "down": (1536, 576),
    "qkv": (576, 960),
    "o": (576, 576),
    "lm_head": (576, 49152),
}


def main() -> None:
    rows = [int(r) for r in sys.argv[1].split(",")] if len(sys.argv) > 1 else ROWS
    kernel = bf16_kernel(torch.bfloat16, torch.device("cpu"), default_cache_dir(), 2, True)
    torch.set_num_threads(1)
    packed = {
        name: (kernel.pack(torch.randn(n, k).to(torch.bfloat16)), n)
        for name, (k, n) in SHAPES.items()
    }
    xs = {
        (name, r): torch.randn(r, k).to(torch.bfloat16)
        for name, (k, _) in SHAPES.items()
        for r in rows
    }
    times: dict[tuple[str, int], list[float]] = {key: [] for key in xs}
    for _ in range(40):
        for (name, r), x in xs.items():
            panels, n = packed[name]
            start = time.perf_counter()
            kernel.linear(x, panels, None, n)
            times[(name, r)].append(time.perf_counter() - start)
    for name in SHAPES:
        cells = (f"{r}:{1e6 * sorted(times[(name, r)])[10]:.0f}" for r in rows)
        print(name, " ".join(cells))


if __name__ == "__main__":
    main()
