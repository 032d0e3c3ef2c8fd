"""C kernels of the CPU engine, built once per machine and cached.

A kernel's library is built by the system's C compiler (`$CC`, else `cc`; `-O3
-march=native` and any extra flags) and cached under the model cache, named by the hash of
its source and the headers beside it, compiler, flags and CPU, so a changed source or
header or another CPU builds anew and processes building at once each install a whole file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import weakref
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")


def cpu_identity() -> str:
    """The CPU the library is built for: its model and feature flags (Linux), else the machine."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def library_path(source: Path, cache_dir: Path, compiler: str, flags: tuple[str, ...]) -> Path:
    digest = hashlib.sha256()
    headers = sorted(source.parent.glob("*.h"))  # what the source may include
    for part in (source, *headers):
        digest.update(part.read_bytes())
    for part in (compiler, " ".join(flags)):
        digest.update(part.encode())
    digest.update(cpu_identity().encode())
    return cache_dir / "kernels" / f"{source.stem}-{digest.hexdigest()[:16]}.so"


def build(source: Path, cache_dir: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """The compiled library of `source` for this machine, building it first if the cache
    lacks it; raises OSError (no compiler) or CalledProcessError (it failed)."""
    compiler = os.environ.get("CC", "cc")
    flags = FLAGS + extra_flags
    path = library_path(source, cache_dir, compiler, flags)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        built = Path(tmp) / path.name
        subprocess.run(
            [compiler, *flags, "-o", str(built), str(source)],
            check=True,
            capture_output=True,
            text=True,
        )
        built.replace(path)  # atomic: processes building at once each install a whole file
    return path


def load(source: Path, cache_dir: Path, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Builds (once per machine) and loads `source`; raises as `build` does."""
    return ctypes.CDLL(str(build(source, cache_dir, extra_flags)))


class Pool:
    """A kernel library's pool of helper threads (pool.h), joined when this is collected;
    `handle` is None (the caller alone) for no helpers."""

    def __init__(self, library: ctypes.CDLL, helpers: int):
        self.handle = None
        if helpers <= 0:
            return
        new, free = library.pool_new, library.pool_free
        new.restype, new.argtypes = ctypes.c_void_p, [ctypes.c_int]
        free.restype, free.argtypes = None, [ctypes.c_void_p]
        self.handle = new(helpers)
        if self.handle is None:
            raise OSError(f"could not start {helpers} kernel threads")
        weakref.finalize(self, free, self.handle)
