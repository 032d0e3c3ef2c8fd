"""bfloat16 linear layers on the CPU as one compiled kernel (bf16_linear.c).

A one-token forward reads every weight once and does little else: it is bound by memory.
torch's bfloat16 matrix product streams a decode step's weights at about 8 GB/s on the
2-core AMD EPYC (Zen 4, AVX512_BF16) measured here, where one core reads memory at 22-27;
on CPUs without bf16 arithmetic it emulates it, and a 17-token tree costs 4-6 times its
float32 forward (bench/RESULTS.md). Here each weight is packed once into panels of 64
outputs, which a decode step streams once and larger batches reuse from the cache, tile
after tile of rows.

Every output is one chain of multiply-adds over the input in order, in float32, whatever
rows share the call, so a row's result never depends on the rows beside it: the forward
stays batch-invariant (workers/engine/attention.py), which lossless bfloat16 speculation
needs. The kernel is built per machine (workers/engine/native.py) for AVX512_BF16 where the
CPU has it, else for AVX2 with FMA; elsewhere, or where it does not build, the engine keeps
torch's bfloat16 layers.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
from pathlib import Path

import torch
from torch import nn

from workers.engine import native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("bf16_linear.c")
# rows the tile unit computes at once (bf16_linear.c's AMX_ROWS): on it a call of 17 rows
# costs what one of 32 does, each layer's products taking another pass over the weights
AMX_ROWS = 16
# rows a tile of the vector paths computes (bf16_linear.c's RT, AVX512_BF16 and AVX2 alike)
KERNEL_ROWS = 6


class Bf16Kernel:
    """The loaded kernel: packs weights, multiplies rows by them on `threads` threads (the
    caller and a pool of helpers, workers/engine/pool.h); the results do not depend on it.
    `amx`: on the CPU's tile unit where it has one and Linux grants it (every call then,
    whatever its rows, so a row's result still does not depend on the rows beside it)."""

    def __init__(self, library: ctypes.CDLL, threads: int = 1, amx: bool = True):
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        self._elements = library.panel_elements
        self._elements.restype, self._elements.argtypes = size, [size, size]
        self._pack = library.pack
        self._pack.restype, self._pack.argtypes = None, [pointer, pointer, size, size]
        self._linear = library.linear
        self._linear.restype = ctypes.c_int
        self._linear.argtypes = [pointer] * 5 + [size] * 3 + [ctypes.c_int]
        self.linear_address = ctypes.cast(self._linear, ctypes.c_void_p).value  # for C callers
        self.amx = amx and bool(library.amx_ready())
        self.threads = max(1, threads)
        self.pool = native.Pool(library, self.threads - 1)  # the compiled attention's too

    @classmethod
    def load(
        cls,
        cache_dir: Path,
        threads: int = 1,
        extra_flags: tuple[str, ...] = (),
        amx: bool = True,
    ) -> Bf16Kernel:
        """Builds (once per machine) and loads the kernel; raises OSError or
        CalledProcessError where it cannot. `extra_flags` (tests) narrow the target CPU."""
        return cls(native.load(SOURCE, cache_dir, extra_flags), threads, amx)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        # weight: (N, K) bfloat16 -> the kernel's panels, flat
        n, k = weight.shape
        weight = weight.contiguous()
        panels = torch.empty(self._elements(n, k), dtype=torch.bfloat16)
        self._pack(weight.data_ptr(), panels.data_ptr(), n, k)
        return panels

    def linear(
        self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int
    ) -> torch.Tensor:
        # x: (R, K) bfloat16, contiguous; bias: (N,) -> (R, N) bfloat16
        if x.dtype != torch.bfloat16:  # the kernel reads the bytes as bfloat16
            raise TypeError(f"the bfloat16 linear kernel takes bfloat16 rows, not {x.dtype}")
        rows, k = x.shape
        y = torch.empty(rows, n, dtype=torch.bfloat16)
        bias_ptr = None if bias is None else bias.data_ptr()
        status = self._linear(
            self.pool.handle,
            x.data_ptr(),
            panels.data_ptr(),
            bias_ptr,
            y.data_ptr(),
            rows,
            n,
            k,
            self.amx,
        )
        if status:
            raise MemoryError("the bfloat16 linear kernel could not allocate its scratch")
        return y


class Bf16Linear(nn.Module):
    """y = x W^T + b by the kernel, W packed once; inference only (no autograd)."""

    def __init__(self, linear: nn.Linear, kernel: Bf16Kernel):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel = kernel
        self.panels = kernel.pack(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()  # (out,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (..., in) -> (..., out)
        rows = x.reshape(-1, self.in_features).contiguous()  # (R, in)
        y = self.kernel.linear(rows, self.panels, self.bias, self.out_features)
        return y.reshape(*x.shape[:-1], self.out_features)


def bf16_kernel(
    dtype: torch.dtype, device: torch.device, cache_dir: Path, threads: int = 1, amx: bool = True
) -> Bf16Kernel | None:
    """The kernel for bfloat16 layers on the CPU, or None (saying why where it does not build)."""
    if dtype != torch.bfloat16 or device.type != "cpu":
        return None
    try:
        return Bf16Kernel.load(cache_dir, threads, amx=amx)
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", None) or error
        log.warning("keeping torch's bfloat16 linear layers: the kernel did not build: %s", detail)
        return None
