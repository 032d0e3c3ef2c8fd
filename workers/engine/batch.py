"""What one forward feeds the model, and how it is laid out.

`SlotInput` describes one slot's uncommitted region as a tree (parents, -1 =
child of the committed prefix) and feeds its last T tokens; `build_batch`
derives positions and the tree attention masks from it and lays B slots out
as one `ForwardBatch` of N = sum(T_b) tokens, unpadded, with the KV pool
positions (workers/engine/kv_cache.py) each token writes and each group reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from workers.engine.kv_cache import NULL_BLOCK, PagedKVCache
from workers.speculation.tree import depths, tree_mask


@dataclass(frozen=True)
class SlotInput:
    """One slot's share of a forward."""

    slot: int
    prefix_len: int  # committed cache entries, all visible to the new tokens
    parents: list[int]  # (U,) the uncommitted region as a tree; -1 = child of the prefix
    tokens: list[int]  # (T,) the region's last T tokens, fed now; the rest is cached
    logits_for: int = 1  # how many trailing tokens need logits


@dataclass(frozen=True)
class RowGroup:
    """Rows of a batch with the same number of new tokens T: one attention call."""

    # (G * T,) long: their tokens among the N, row after row; None: the group is every row
    tokens: torch.Tensor | None
    slots: torch.Tensor  # (G,) long: their cache slots
    new: int  # T: new tokens per row
    width: int  # L: cache entries their attention reads
    # (G * L,) long: the KV pool position of each row's columns 0..L-1, row after row
    # (the null block past a row's own length)
    positions: torch.Tensor
    mask: torch.Tensor  # (G, 1, T, L) bool: which cache entries each new token sees


@dataclass(frozen=True)
class ForwardBatch:
    """New tokens of B slots for one forward: N = sum(T_b) tokens, row after row, unpadded.

    Each slot has a committed prefix (visible to every new token) followed by
    an uncommitted region of U tokens laid out as a tree; this forward feeds the
    last T_b tokens of that region (the first U - T_b are already cached).
    Every layer runs on the N tokens as they are, so a long prefill batched
    with one-token decodes costs what its tokens cost; attention runs once per
    group of rows with equal T_b (decodes together, each prefill apart).
    """

    tokens: torch.Tensor  # (N,) long: new tokens
    positions: torch.Tensor  # (N,) long: RoPE positions
    token_positions: torch.Tensor  # (N,) long: the KV pool position each token's key/value goes to
    groups: list[RowGroup]
    ends: list[int]  # (B,): where each row's tokens end among the N


def build_batch(rows: list[SlotInput], cache: PagedKVCache, device: torch.device) -> ForwardBatch:
    """The forward of `rows` laid out for the model: N tokens, their positions, pool positions,
    and one attention mask per group of rows with equal T. Each row's slot must already
    hold blocks for its L_b columns (`PagedKVCache.reserve`)."""
    widths = [r.prefix_len + len(r.parents) for r in rows]  # L_b
    room = cache.max_seq_len
    if max(widths) > room:
        raise ValueError(f"sequence of {max(widths)} tokens exceeds the cache ({room} tokens)")
    lengths = [len(r.tokens) for r in rows]  # T_b
    starts = [0, *accumulate(lengths)]  # row b's tokens: starts[b] to starts[b + 1]
    positions, masks = [], []
    for r in rows:
        n, u = len(r.tokens), len(r.parents)
        parents = torch.tensor(r.parents, dtype=torch.long)  # (U,)
        positions.append(r.prefix_len + depths(parents)[u - n :] - 1)  # (T_b,)
        mask = torch.ones(n, r.prefix_len + u, dtype=torch.bool)  # (T_b, L_b)
        mask[:, r.prefix_len :] = tree_mask(parents)[u - n :]
        masks.append(mask)
    groups = []
    for new in sorted(set(lengths)):
        members = [b for b, n in enumerate(lengths) if n == new]
        width = max(widths[b] for b in members)
        mask = torch.zeros(len(members), 1, new, width, dtype=torch.bool)  # (G, 1, T, L)
        read = torch.full((len(members), width), NULL_BLOCK * cache.block_size)  # (G, L)
        for i, b in enumerate(members):
            mask[i, 0, :, : widths[b]] = masks[b]
            read[i, : widths[b]] = cache.positions(rows[b].slot, torch.arange(widths[b]))
        tokens = None
        if len(members) < len(rows):
            tokens = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in members])
        groups.append(
            RowGroup(
                tokens=None if tokens is None else tokens.to(device),
                slots=torch.tensor([rows[b].slot for b in members], device=device),
                new=new,
                width=width,
                positions=read.flatten().to(device),
                mask=mask.to(device),
            )
        )
    written = [
        cache.positions(r.slot, torch.arange(w - n, w))
        for r, w, n in zip(rows, widths, lengths, strict=True)
    ]  # (T_b,) each
    return ForwardBatch(
        tokens=torch.tensor([x for r in rows for x in r.tokens], device=device),
        positions=torch.cat(positions).to(device),
        token_positions=torch.cat(written).to(device),
        groups=groups,
        ends=starts[1:],
    )
