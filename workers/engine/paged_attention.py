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
twenty-odd small torch ops a layer it replaces. The query heads of one
key/value head attend together, each key read once for them. Beside the
bfloat16 kernel (workers/engine/bf16_linear.py) the attention shares its
(token, head group) items among that kernel's threads, each item whole to one
thread: the threads change no bit.

The library also has the blocks' other small ops: the RMS norm
(`CompiledAttention.rms_norm`), whose mean of squares sums in the kernel's own
fixed order, the residual add fused with the next norm (`add_rms_norm`, as
vLLM's fused_add_rms_norm) and the MLP's silu(gate) * up (`swiglu`), each
rounded as torch's ops round; silu's e^x is the kernel's own (Cephes' expf:
float32 results within 3 units in the last place of torch's, bfloat16 ones the
same bits in every case measured, arguments below -87 aside, where silu is
within 1e-36 of 0). For a bfloat16 model with the bfloat16 kernel's packed
weights, `CompiledBlocks` runs every decoder block in one call, calling that
kernel's products from C: the same ops in the same order as the blocks one by
one, so the same bits, without the ~400 Python calls of a forward.

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
from workers.engine.bf16_linear import Bf16Kernel
from workers.engine.kv_cache import PagedKVCache
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
    """The loaded kernel for one cache dtype: a layer's attention, its RMS norms (before the
    attention and before the MLP; each but the first block's with the residual add before
    it) and its SwiGLU. With `pool` (the bfloat16 kernel's helper threads,
    workers/engine/pool.h) the attention shares its (token, head) pairs among them."""

    def __init__(self, library: ctypes.CDLL, dtype: torch.dtype, pool: native.Pool | None = None):
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        self.library, self.dtype = library, dtype
        self.function = getattr(library, f"rope_attend_{SUFFIX[dtype]}")
        self.function.restype = ctypes.c_int
        self.function.argtypes = [pointer] * 10 + [size] * 5 + [ctypes.c_float]
        self.pool = pool
        self.norm = getattr(library, f"rms_norm_{SUFFIX[dtype]}")
        self.norm.restype = None
        self.norm.argtypes = [pointer] * 3 + [size] * 2 + [ctypes.c_float]
        self.add_norm = getattr(library, f"add_rms_norm_{SUFFIX[dtype]}")
        self.add_norm.restype = None
        self.add_norm.argtypes = [pointer] * 5 + [size] * 2 + [ctypes.c_float]
        self.gated = getattr(library, f"swiglu_{SUFFIX[dtype]}")
        self.gated.restype = None
        self.gated.argtypes = [pointer] * 2 + [size] * 2

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

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x, delta: (N, E), weight: (E,), in the cache's dtype -> x + delta as torch adds them,
        # and its rms_norm: (N, E) each, in one pass over the rows
        x, delta = x.contiguous(), delta.contiguous()
        total, out = torch.empty_like(x), torch.empty_like(x)
        rows, width = x.shape
        self.add_norm(
            x.data_ptr(), delta.data_ptr(), weight.data_ptr(), total.data_ptr(), out.data_ptr(),
            rows, width, eps,
        )  # fmt: skip
        return total, out

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        # gate_up: (N, 2F), gate then up, in the cache's dtype -> (N, F) silu(gate) * up,
        # each of the two ops rounded as torch rounds it (silu's e^x is the kernel's own)
        gate_up = gate_up.contiguous()
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, width)
        self.gated(gate_up.data_ptr(), out.data_ptr(), rows, width)
        return out


class CompiledBlocks:
    """Every decoder block of a bfloat16 NativeLlama (workers/engine/llama.py) in one call
    (paged_attention.c's `blocks_bf16`): the same ops in the same order as the blocks run
    them one by one (norms, the bfloat16 kernel's products, attention, SwiGLU, residual
    adds), so the same bits, without a Python call per op (about 400 a forward). Its weights
    are the blocks' own packed panels and norms."""

    def __init__(self, attention: CompiledAttention, kernel: Bf16Kernel, model):
        if attention.dtype != torch.bfloat16:
            raise ValueError(f"the compiled blocks run bfloat16 models, not {attention.dtype}")
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        self.function = attention.library.blocks_bf16
        self.function.restype = ctypes.c_int
        self.function.argtypes = [pointer, pointer, ctypes.c_int, pointer, size]
        self.function.argtypes += [pointer] * 8 + [size] * 7 + [ctypes.c_float] * 2
        self.kernel, self.shape = kernel, model.shape
        weights = [
            [b.norm_attn, b.qkv_proj, b.o_proj, b.norm_mlp, b.gate_up_proj, b.down_proj]
            for b in model.blocks
        ]
        per_block = attention.library.layer_weights()
        addresses = [address for block in weights for address in self.addresses(block)]
        if len(addresses) != per_block * len(weights):
            raise ValueError("the compiled blocks' weight table does not match the library's")
        self.weights = (pointer * len(addresses))(*addresses)
        self.ffn = model.blocks[0].down_proj.in_features  # F

    @staticmethod
    def addresses(block: list) -> list[int | None]:
        """A block's LAYER_WEIGHTS pointers: each norm's weight, each product's panels and bias."""
        out: list[int | None] = []
        for part in block:
            if isinstance(part, torch.Tensor):
                out.append(part.data_ptr())
            else:  # Bf16Linear
                out += [part.panels.data_ptr(), None if part.bias is None else part.bias.data_ptr()]
        return out

    def __call__(self, x, cos, sin, cache: PagedKVCache, batch: ForwardBatch) -> torch.Tensor:
        # x: (N, E) the first block's input; cos, sin: (N, 1, D) -> (N, E) the last block's
        # output; writes every block's keys and values at batch.token_positions
        s, keys = self.shape, batch.visible
        x = x.clone(memory_format=torch.contiguous_format)  # (N, E), replaced block by block
        status = self.function(
            self.kernel.linear_address, self.kernel.pool.handle, self.kernel.amx, self.weights,
            s.num_layers, x.data_ptr(), cos.data_ptr(), sin.data_ptr(), cache.k.data_ptr(),
            cache.v.data_ptr(), batch.token_positions.data_ptr(), keys.positions.data_ptr(),
            keys.starts.data_ptr(), x.shape[0], s.hidden_size, self.ffn, s.num_heads,
            s.num_kv_heads, cache.k.shape[2], s.head_dim, s.rms_norm_eps, s.head_dim**-0.5,
        )  # fmt: skip
        if status == 2:
            raise MemoryError("the compiled blocks could not allocate their scratch")
        if status:
            raise RuntimeError(f"the compiled blocks refused their arguments (status {status})")
        return x


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
