"""What one forward feeds the model, and how it is laid out.

`SlotInput` describes one slot's uncommitted region as a tree (parents, -1 =
child of the committed prefix) and feeds its last T tokens; `build_batch`
derives positions and the tree attention masks from it and lays B slots out
as one `ForwardBatch` of N = sum(T_b) tokens, unpadded, with the KV pool
positions (workers/engine/kv_cache.py) each token writes and reads: for the
compiled attention (workers/engine/paged_attention.py) each token's own list
of visible keys, for the chunked one (workers/engine/attention.py) key rows
gathered per group of rows.
"""

from __future__ import annotations

from collections.abc import Callable
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
class VisibleKeys:
    """Each new token's visible keys by pool position, in sequence order (the committed
    prefix, then its ancestors and itself): all the compiled attention reads of it."""

    positions: torch.Tensor  # (M,) long: token after token, its visible keys' pool positions
    starts: torch.Tensor  # (N + 1,) long: token n's keys are positions[starts[n]:starts[n + 1]]


@dataclass(frozen=True)
class KeyRows:
    """K rows of L key columns one attention call reads, gathered from the KV pool."""

    count: int  # K
    width: int  # L: a multiple of the KV block size (the attention's chunk)
    # (K * Hkv * L,) long: the flat pool entry (head * P + pool position) of each row's
    # columns 0..L-1 for each key/value head, row after row, head after head (the null
    # block past the row's own columns): one gather gives (K, Hkv, L, D) contiguous
    entries: torch.Tensor
    mask: torch.Tensor  # (G, 1, T, L) bool: which columns each new token of each slot sees


@dataclass(frozen=True)
class RowGroup:
    """Rows of a batch with the same number of new tokens T: one attention call.

    Each new token must read its visible keys in sequence order from column 0
    (the committed prefix, then its own ancestors), in the columns a
    token-by-token decode would put them (workers/engine/attention.py). A
    chain (prefill, decode) reads its slot's columns as they are: `shared`
    holds them all. A tree node's ancestors are scattered through the
    region: `shared` holds the prefix's whole blocks, common to the slot's
    tokens, and `tail` each token's own rest (the prefix's last partial block,
    then its ancestors and itself), gathered.
    """

    # (G * T,) long: their tokens among the N, row after row; None: the group is every row
    tokens: torch.Tensor | None
    new: int  # T: new tokens per row
    shared: KeyRows  # K = G: one key row per slot
    tail: KeyRows | None  # K = G * T: one key row per token, continuing `shared`; None: chains


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
    groups: list[RowGroup]  # the chunked attention's calls; none for the compiled one
    visible: VisibleKeys | None  # the compiled attention's keys; None for the chunked one
    ends: list[int]  # (B,): where each row's tokens end among the N


def is_chain(mask: torch.Tensor) -> bool:
    """Whether every token of a (T, L) mask sees exactly the columns before and at its own."""
    seen = mask.sum(-1, keepdim=True)  # (T, 1)
    return bool((mask == (torch.arange(mask.shape[-1]) < seen)).all())


Widen = Callable[[int], int]  # a key width (whole blocks) -> the width to pad it to


def key_rows(
    reads: list[torch.Tensor],
    seen: list[torch.Tensor],
    cache: PagedKVCache,
    device: torch.device,
    widen: Widen | None = None,
) -> KeyRows:
    """K key rows from their pool positions (n_k,) each, padded with the null block to a
    whole number of blocks, and to `widen`'s width where given (masked null-block columns
    change no output: workers/engine/attention.py); `seen` holds each slot's (T, n_g) mask
    over its columns."""
    block = cache.block_size
    width = -(-max(len(r) for r in reads) // block) * block
    if widen is not None:
        width = widen(width)
    read = torch.full((len(reads), width), NULL_BLOCK * block)  # (K, L)
    for k, r in enumerate(reads):
        read[k, : len(r)] = r
    mask = torch.zeros(len(seen), 1, seen[0].shape[0], width, dtype=torch.bool)  # (G, 1, T, L)
    for g, m in enumerate(seen):
        mask[g, 0, :, : m.shape[1]] = m
    heads, pool = cache.k.shape[1], cache.k.shape[2]  # Hkv, P
    entries = torch.arange(heads)[None, :, None] * pool + read[:, None, :]  # (K, Hkv, L)
    return KeyRows(len(reads), width, entries.flatten().to(device), mask.to(device))


def visible_keys(
    columns: list[torch.Tensor], masks: list[torch.Tensor | None], device: torch.device
) -> VisibleKeys:
    """Each row's (L_b,) pool positions of its columns under its (T_b, L_b) mask, listed token
    by token: a token's visible columns in column order, which is its sequence order. A mask
    of None: the row's one token sees every column (a decode step)."""
    listed = [
        c if m is None else c.expand(m.shape[0], -1)[m] for c, m in zip(columns, masks, strict=True)
    ]
    counts = [
        [len(c)] if m is None else m.sum(1).tolist() for c, m in zip(columns, masks, strict=True)
    ]
    starts = [0, *accumulate(n for row in counts for n in row)]  # (N + 1,)
    return VisibleKeys(torch.cat(listed).to(device), torch.tensor(starts, device=device))


def row_groups(
    rows: list[SlotInput],
    columns: list[torch.Tensor],
    masks: list[torch.Tensor],
    starts: list[int],
    cache: PagedKVCache,
    device: torch.device,
    widen: Widen | None = None,
) -> list[RowGroup]:
    """The chunked attention's calls, one per group of rows with equal T: each row's (L_b,)
    pool positions of its columns under its (T_b, L_b) mask, its tokens from starts[b];
    key rows padded to `widen`'s widths where given."""
    lengths = [len(r.tokens) for r in rows]
    groups = []
    for new in sorted(set(lengths)):
        members = [b for b, n in enumerate(lengths) if n == new]
        tail = None
        if all(is_chain(masks[b]) for b in members):
            shared = key_rows(
                [columns[b] for b in members], [masks[b] for b in members], cache, device, widen
            )
        else:
            whole = [rows[b].prefix_len // cache.block_size * cache.block_size for b in members]
            shared = key_rows(
                [columns[b][:w] for b, w in zip(members, whole, strict=True)],
                [masks[b][:, :w] for b, w in zip(members, whole, strict=True)],
                cache,
                device,
                widen,
            )
            reads, seen = [], []
            for b, w in zip(members, whole, strict=True):
                rest = [row.nonzero().squeeze(1)[w:] for row in masks[b]]  # (n_t,) each, in order
                reads += [columns[b][r] for r in rest]
                counts = torch.tensor([len(r) for r in rest])  # (T,)
                seen.append(torch.arange(int(counts.max())) < counts[:, None])  # (T, max n_t)
            tail = key_rows(reads, seen, cache, device, widen)
        tokens = None
        if len(members) < len(rows):
            tokens = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in members])
        groups.append(
            RowGroup(
                tokens=None if tokens is None else tokens.to(device),
                new=new,
                shared=shared,
                tail=tail,
            )
        )
    return groups


def build_batch(
    rows: list[SlotInput],
    cache: PagedKVCache,
    device: torch.device,
    listed: bool = False,
    widen: Widen | None = None,
) -> ForwardBatch:
    """The forward of `rows` laid out for the model: N tokens, their positions, pool positions,
    and what attention reads: with `listed` each token's visible keys (the compiled
    attention), else one call per group of rows with equal T (the chunked one), its key
    rows padded to `widen`'s widths where given (so that a CUDA graph captured for one
    width serves the next steps: workers/engine/cuda_graphs.py). Each row's slot must
    already hold blocks for its L_b columns (`PagedKVCache.reserve`)."""
    widths = [r.prefix_len + len(r.parents) for r in rows]  # L_b
    room = cache.max_seq_len
    if max(widths) > room:
        raise ValueError(f"sequence of {max(widths)} tokens exceeds the cache ({room} tokens)")
    lengths = [len(r.tokens) for r in rows]  # T_b
    starts = [0, *accumulate(lengths)]  # row b's tokens: starts[b] to starts[b + 1]
    positions: list[list[int]] = []  # (T_b,) per row
    masks: list[torch.Tensor | None] = []  # (T_b, L_b) per row; None: all True
    for r in rows:
        n, u = len(r.tokens), len(r.parents)
        if u == n == 1:  # a decode step: one token, the prefix's child, sees every column
            positions.append([r.prefix_len])
            masks.append(None)
            continue
        parents = torch.tensor(r.parents, dtype=torch.long)  # (U,)
        positions.append((r.prefix_len + depths(parents)[u - n :] - 1).tolist())
        mask = torch.ones(n, r.prefix_len + u, dtype=torch.bool)  # (T_b, L_b)
        mask[:, r.prefix_len :] = tree_mask(parents)[u - n :]
        masks.append(mask)
    columns = [cache.positions(r.slot, torch.arange(w)) for r, w in zip(rows, widths, strict=True)]
    visible, groups = None, []
    if listed:
        visible = visible_keys(columns, masks, device)
    else:
        full = [
            torch.ones(1, w, dtype=torch.bool) if m is None else m
            for m, w in zip(masks, widths, strict=True)
        ]
        groups = row_groups(rows, columns, full, starts, cache, device, widen)
    written = [c[w - n :] for c, w, n in zip(columns, widths, lengths, strict=True)]  # (T_b,)
    return ForwardBatch(
        tokens=torch.tensor([x for r in rows for x in r.tokens], device=device),
        positions=torch.tensor([p for row in positions for p in row], device=device),
        token_positions=torch.cat(written).to(device),
        groups=groups,
        visible=visible,
        ends=starts[1:],
    )
