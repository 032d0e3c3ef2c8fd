"""Batch-invariant paged attention as one compiled loop: the CPU engine's attention.

attention.py reaches batch invariance with torch ops over fixed chunks of 16
keys, about a hundred small ops a layer whatever the batch; on a CPU their
fixed costs, and gathering each row's keys out of the paged pool first, make
a one-token forward slower than transformers' (bench/RESULTS.md). Here one C
call (paged_attention.c) does a layer's attention for every token of the
batch: each (token, query head) reads its own visible keys straight from the
pool, listed by position in sequence order (`VisibleKeys`, built once per
forward by workers/engine/batch.py), and nothing else, so its output depends
on that list alone, never on the batch: the property attention.py has, by
construction instead of by padding. Every sum runs in one fixed order (dot
products over 8 lanes, then keys in list order), in float32 whatever the
cache's dtype (float32 or bfloat16). The same call first applies the rotary
position embedding to the new queries and keys and writes the keys and values
into the pool, rounding as torch's ops do in that dtype: the same bits as the
twenty-odd small torch ops a layer it replaces. The library also has the
blocks' RMS norm (`CompiledAttention.rms_norm`), whose mean of squares sums in
the kernel's own fixed order. The query heads of one key/value head attend together, each
key read once for them. Beside the bfloat16 kernel (workers/engine/bf16_linear.py) the
attention shares its (token, head group) items among that kernel's threads, each item whole
to one thread: the threads change no bit.

The library is built once per machine and cached (workers/engine/native.py).
Where no compiler builds it, or the engine runs off the CPU or in float16, the
engine keeps attention.py's chunked attention (`EngineConfig.attention`).

Shapes: N tokens, H query heads, Hkv key/value heads, P pool positions, D head
size, M listed keys in all.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
from pathlib import Path
from typing import get_args

import torch

from workers.engine import native
from workers.engine.batch import ForwardBatch
from workers.settings import Attention

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.c")
LANES = 8  # the kernel's vector width: the head size must be a multiple of it
MAX_DIM = 512  # the kernel's largest head size
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}  # of the kernel's entries per dtype
ATTENTION = get_args(Attention)  # EngineConfig.attention


def build(cache_dir: Path) -> Path:
    """The compiled library for this machine (workers/engine/native.py)."""
    return native.build(SOURCE, cache_dir)


def supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the compiled attention cannot serve this engine, or None if it can."""
    if device.type != "cpu":
        return f"it runs on the CPU, not {device.type}"
    if dtype not in SUFFIX:
        return f"it reads float32 or bfloat16 caches, not {dtype}"
    if head_dim % LANES or head_dim > MAX_DIM:
        return f"head size {head_dim} is not a multiple of {LANES} up to {MAX_DIM}"
    return None


class CompiledAttention:
    """The loaded kernel for one cache dtype: a layer's attention, and its RMS norms (before
    the attention and before the MLP). With `pool` (the bfloat16 kernel's helper threads,
    workers/engine/pool.h) the attention shares its (token, head) pairs among them."""

    def __init__(self, library: ctypes.CDLL, dtype: torch.dtype, pool: native.Pool | None = None):
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        self.function = getattr(library, f"rope_attend_{SUFFIX[dtype]}")
        self.function.restype = ctypes.c_int
        self.function.argtypes = [pointer] * 10 + [size] * 5 + [ctypes.c_float]
        self.pool = pool
        self.norm = getattr(library, f"rms_norm_{SUFFIX[dtype]}")
        self.norm.restype = None
        self.norm.argtypes = [pointer] * 3 + [size] * 2 + [ctypes.c_float]

    @classmethod
    def load(
        cls, cache_dir: Path, dtype: torch.dtype, pool: native.Pool | None = None
    ) -> CompiledAttention:
        """Builds (once per machine) and loads the kernel; raises OSError or
        CalledProcessError where it cannot."""
        return cls(native.load(SOURCE, cache_dir), dtype, pool)

    def __call__(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        # qkv: (N, (H + 2 Hkv) D) the new tokens' projections; cos, sin: (N, 1, D);
        # k_pool, v_pool: (Hkv, P, D) one layer's pool, contiguous; all in the cache's dtype
        # -> (N, H D): writes the rotated keys and the values at batch.token_positions,
        # then attends
        kv_heads, pool, dim = k_pool.shape
        n, heads = qkv.shape[0], qkv.shape[1] // dim - 2 * kv_heads
        qkv, keys = qkv.contiguous(), batch.visible
        out = qkv.new_empty(n, heads * dim)  # (N, H D)
        helpers = None if self.pool is None else self.pool.handle
        status = self.function(
            helpers, qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), k_pool.data_ptr(),
            v_pool.data_ptr(), batch.token_positions.data_ptr(), keys.positions.data_ptr(),
            keys.starts.data_ptr(), out.data_ptr(), n, heads, kv_heads, pool, dim, dim**-0.5,
        )  # fmt: skip
        if status:
            raise RuntimeError(f"the compiled attention refused its arguments (status {status})")
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # x: (N, E), weight: (E,), in the cache's dtype -> (N, E); llama.rms_norm's arithmetic
        # with the mean of squares summed in the kernel's order
        x = x.contiguous()
        out = torch.empty_like(x)
        self.norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
        return out


def compiled_attention(
    choice: str,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    cache_dir: Path,
    pool: native.Pool | None = None,
) -> CompiledAttention | None:
    """The kernel for `choice` ("auto", "compiled" or "chunked", EngineConfig.attention), or
    None for attention.py's chunked attention. "compiled" raises where the kernel cannot
    serve; "auto" falls back to chunked then, saying why. `pool`: helper threads it may use."""
    if choice not in ATTENTION:
        raise ValueError(f"attention {choice!r} is not one of {', '.join(ATTENTION)}")
    if choice == "chunked":
        return None
    reason = supported(device, dtype, head_dim)
    if reason is None:
        try:
            return CompiledAttention.load(cache_dir, dtype, pool)
        except (OSError, subprocess.CalledProcessError) as error:
            detail = getattr(error, "stderr", None) or error
            reason = f"it did not build: {detail}"
    if choice == "compiled":
        raise ValueError(f"the compiled attention cannot serve this engine: {reason}")
    log.warning("using the chunked attention: the compiled one cannot serve, %s", reason)
    return None
