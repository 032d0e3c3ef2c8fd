"""The machine a benchmark ran on, in one line, and how busy it was."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def load_words() -> str:
    """The 1, 5 and 15-minute load averages as "a / b / c"."""
    return " / ".join(f"{x:.1f}" for x in load_average())


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def describe() -> str:
    import torch

    memory = memory_gib()
    parts = [
        f"{cpu_model()} ({platform.machine()})",
        f"{os.cpu_count()} cores",
        f"{memory:.0f} GiB RAM" if memory else "",
        f"torch {torch.__version__} with {torch.get_num_threads()} threads",
        "CUDA " + torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU only",
        f"Python {platform.python_version()}",
    ]
    return ", ".join(p for p in parts if p)
