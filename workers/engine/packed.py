"""Linear layers with oneDNN-packed weights (float32 on the CPU), or in fixed row tiles (GPUs).

A transformers `nn.Linear` multiplies by its (out, in) weight with a GEMM
that re-packs the weight on every call. For the few rows a decode step or a
draft tree feeds (1 to ~64 tokens), that packing costs more than the
multiplication: on a 2-core x86 CPU, SmolLM2-135M takes 40 ms for one token
and 76 ms for 17. oneDNN can pack each weight once, in the layout its
kernels read (what torch.compile's CPU backend does with frozen weights);
the same forwards then take 23 ms and 34 ms. Logits match the plain layers
to float32 rounding (~1e-4), and each row's result is the same bits
whatever number of rows shares the product (plain float32 layers round a
single row differently from several), which keeps the forward
batch-invariant (workers/engine/attention.py).

On a GPU, BLAS libraries choose a GEMM kernel by the shape, and for a few
rows one that splits the inner dimension (split-K) and adds the parts in
another order, so a token's float32 logits differed in the last bits between
a prefill or a tree and one-token decoding (bench/GPU.md). `TiledLinear`
multiplies in products of exactly `TILE_ROWS` rows, the last padded with
zeros: every row goes through the same kernel with the same reduction order
whatever rows share the call, which makes the forward batch-invariant there
too, at the price of padding a decode step to `TILE_ROWS` rows (on a GPU a
product of 1 or 32 rows reads the same weights in about the same time).

`pack_linears` swaps the native model's linear layers for packed ones when
the model is float32 on the CPU and this torch build has the oneDNN ops, for
the compiled kernel's (workers/engine/bf16_linear.py) when it is bfloat16
on the CPU and the kernel builds, and for tiled ones on a CUDA GPU; otherwise
it leaves the model as it is.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from workers.engine.bf16_linear import Bf16Kernel, Bf16Linear

log = logging.getLogger(__name__)

PACK_ROWS_HINT = 16  # the row count oneDNN tunes the layout for (any count works)
TILE_ROWS = 32  # rows of every product a TiledLinear makes (a 17-token tree: one)
LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # a Block's linear layers


class PackedLinear(nn.Module):
    """y = x W^T + b with W packed once by oneDNN; inference only (no autograd)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()  # (out, in)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()  # (out,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (..., in) -> (..., out)
        rows = x.reshape(-1, self.in_features)  # (R, in)
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)


class TiledLinear(nn.Module):
    """y = x W^T + b in products of exactly `tile` rows, so that each row's result is the
    same bits whatever rows share the call (module docstring); inference only."""

    def __init__(self, linear: nn.Linear, tile: int = TILE_ROWS):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight.detach()  # (out, in)
        self.bias = None if linear.bias is None else linear.bias.detach()  # (out,)
        self.tile = tile

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (..., in) -> (..., out)
        rows = x.reshape(-1, self.in_features)  # (R, in)
        n = rows.shape[0]
        pad = -n % self.tile
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, self.in_features)])  # (R + pad, in)
        y = torch.cat([F.linear(t, self.weight, self.bias) for t in rows.split(self.tile)])
        return y[:n].reshape(*x.shape[:-1], self.out_features)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """float32 on the CPU, with oneDNN ops that give the plain layer's result."""
    if dtype != torch.float32 or device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = nn.Linear(8, 4)
        x = torch.randn(3, 8)
        with torch.inference_mode():
            return torch.allclose(PackedLinear(probe)(x), probe(x), atol=1e-5)
    except (RuntimeError, AttributeError) as error:  # an op missing from this build
        log.info("packed linear layers unavailable: %s", error)
        return False


def pack_linears(model: nn.Module, kernel: Bf16Kernel | None) -> bool:
    """Packs the blocks' projections, the LM head and the input layers (`input_linears`:
    an EAGLE head's fuse) of a NativeLlama; True when it did. `kernel`: the bfloat16
    kernel (`bf16_kernel`), for a bfloat16 model on the CPU."""
    weight = model.lm_head.weight
    if can_pack(weight.dtype, weight.device):
        make = PackedLinear
    elif kernel is not None:

        def make(linear: nn.Linear) -> nn.Module:
            return Bf16Linear(linear, kernel)
    elif weight.is_cuda:
        make = TiledLinear
    else:
        return False
    for block in model.blocks:
        for name in LAYERS:
            setattr(block, name, make(getattr(block, name)))
    model.lm_head = make(model.lm_head)
    for name in model.input_linears:
        setattr(model, name, make(getattr(model, name)))
    return True
