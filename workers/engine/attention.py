"""Batch-invariant attention: a query's output depends on its own keys, never on the batch.

`torch.nn.functional.scaled_dot_product_attention` on the CPU rounds a query's
output differently with the number of keys it reads (masked ones included)
and the number of queries beside it: a prompt prefilled in one forward and
fed one token at a time then leave keys and values one ulp apart, and in
bfloat16 a near-tie between the two most likely tokens flips. Here every
query reduces over its keys the same way whatever the batch looks like
(the fixed-split-size "batch-invariant" attention of He et al. 2025,
"Defeating Nondeterminism in LLM Inference"):

1. keys are cut into chunks of `chunk` positions from column 0, so a query
   with n visible keys always sees the same chunks, the last one padded;
2. scores and each chunk's probability-weighted values are matrix products
   of fixed width (`chunk`), with at least `MIN_ROWS` rows: float32 products
   of fewer rows take another kernel that rounds differently, more rows
   round each row the same (torch 2.13 CPU, MKL and oneDNN);
3. the softmax uses the exact maximum over all visible scores, so masked
   keys and padded chunks contribute exact zeros;
4. chunk sums are added in chunk order (`cumsum`, sequential), where a
   trailing chunk of zeros changes nothing.

The arithmetic is float32 whatever the cache's dtype. The query's keys must
sit in the same columns in every feeding pattern: visible keys first, in
sequence order (a chain reads its row as it is; a tree node reads its own
prefix and ancestors, gathered: workers/engine/batch.py).

Shapes: B batch entries, Hkv key/value heads, R queries per key/value head,
L keys (a multiple of the chunk), C = L / chunk chunks, D head size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MIN_ROWS = 4  # rows per product (and a multiple of it): fewer take a differently rounding kernel


def attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, chunk: int
) -> torch.Tensor:
    # q: (B, Hkv, R, D); keys, values: (B, Hkv, L, D); mask: (B, 1, R, L) bool -> (B, Hkv, R, D)
    b, hkv, r, d = q.shape
    width = keys.shape[2]
    if width % chunk:
        raise ValueError(f"key width {width} is not a multiple of the chunk ({chunk})")
    c = width // chunk
    rows = -(-r // MIN_ROWS) * MIN_ROWS  # padded rows: each thread's share of exp stays vectorized
    q32 = F.pad(q.float() * d**-0.5, (0, 0, 0, rows - r))  # (B, Hkv, rows, D)
    mask = F.pad(mask, (0, 0, 0, rows - r), value=True)  # (B, 1, rows, L)
    k = keys.float().view(b, hkv, c, chunk, d)  # (B, Hkv, C, chunk, D)
    v = values.float().view(b, hkv, c, chunk, d)  # (B, Hkv, C, chunk, D)
    scores = torch.matmul(q32.unsqueeze(2), k.transpose(-1, -2))  # (B, Hkv, C, rows, chunk)
    visible = mask.view(b, 1, rows, c, chunk).transpose(2, 3)  # (B, 1, C, rows, chunk)
    scores = scores.masked_fill(~visible, float("-inf"))
    top = scores.amax(dim=(2, 4), keepdim=True)  # (B, Hkv, 1, rows, 1): exact, order-free
    p = torch.exp(scores - top)  # (B, Hkv, C, rows, chunk), masked: 0
    total = p.sum(-1, keepdim=True).cumsum(2)[:, :, -1]  # (B, Hkv, rows, 1)
    weighted = torch.matmul(p, v).cumsum(2)[:, :, -1]  # (B, Hkv, rows, D)
    return (weighted / total)[:, :, :r].to(q.dtype)
