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
    """Rows of a batch with the same number of new tokens T: one attention call.

    Each new token reads its visible keys in sequence order from column 0 (the
    committed prefix, then its own ancestors), so that its attention sees them
    in the columns a token-by-token decode would (workers/engine/attention.py).
    A chain (prefill, decode) reads its row as it is: `per_token` is False,
    one key row per slot. A tree node's ancestors are scattered through the
    region: `per_token` is True, one key row per new token, gathered.
    """

    # (G * T,) long: their tokens among the N, row after row; None: the group is every row
    tokens: torch.Tensor | None
    new: int  # T: new tokens per row
    width: int  # L: key columns each key row reads, a multiple of the KV block size
    per_token: bool  # key rows: one per token (G * T) when True, one per slot (G) when False
    # (K * L,) long: the KV pool position of each key row's columns 0..L-1, key row after
    # key row (the null block past its visible keys); K = G or G * T
    positions: torch.Tensor
    mask: torch.Tensor  # (G, 1, T, L) bool: which key columns each new token sees


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


def is_chain(mask: torch.Tensor) -> bool:
    """Whether every token of a (T, L) mask sees exactly the columns before and at its own."""
    seen = mask.sum(-1, keepdim=True)  # (T, 1)
    return bool((mask == (torch.arange(mask.shape[-1]) < seen)).all())


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
    block = cache.block_size
    for new in sorted(set(lengths)):
        members = [b for b, n in enumerate(lengths) if n == new]
        per_token = not all(is_chain(masks[b]) for b in members)
        width = max(widths[b] for b in members)
        width = -(-width // block) * block
        mask = torch.zeros(len(members), 1, new, width, dtype=torch.bool)  # (G, 1, T, L)
        null = NULL_BLOCK * block
        read = torch.full((len(members), new if per_token else 1, width), null)  # (G, K/G, L)
        for i, b in enumerate(members):
            columns = cache.positions(rows[b].slot, torch.arange(widths[b]))  # (L_b,)
            if not per_token:
                mask[i, 0, :, : widths[b]] = masks[b]
                read[i, 0, : widths[b]] = columns
                continue
            for t, row in enumerate(masks[b]):
                visible = row.nonzero().squeeze(1)  # (n,) increasing: prefix, ancestors, self
                mask[i, 0, t, : len(visible)] = True
                read[i, t, : len(visible)] = columns[visible]
        tokens = None
        if len(members) < len(rows):
            tokens = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in members])
        groups.append(
            RowGroup(
                tokens=None if tokens is None else tokens.to(device),
                new=new,
                width=width,
                per_token=per_token,
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
