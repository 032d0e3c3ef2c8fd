"""A block-paged KV cache: memory sized by tokens, not by sessions × max context.

Every layer's keys and values live in one pool of P = num_blocks × block_size
positions. A session slot owns a block table: the blocks holding its cache
columns 0, 1, 2, ... in order (column c sits at position
table[c // block_size] * block_size + c % block_size). Blocks are taken as a
session grows (`reserve`, before a forward), dropped past its committed length
(`trim`, after a commit) and returned when it ends (`release`); the tree under
verification lives in blocks too. This is vLLM's PagedAttention layout; the
attention itself gathers a row group's blocks into a contiguous view (one
key row per slot, or per token for a tree: workers/engine/batch.py).

A forward writes its new tokens' keys and values at explicit positions and
reads each row's entries back up to the longest row of its group; positions
past a row's own length read block 0, kept zero and never handed out, and are
masked. Rejected speculation needs no undo: committing keeps the accepted
entries (moved to contiguous columns) and whatever lies beyond the committed
length is overwritten by the next forward (gpt-fast's trick).

The pool is allocated empty (`torch.empty`): a block costs resident memory
only once a session has written to it.

Shapes: Ly layers, Hkv key/value heads, P pool positions, D head size,
S slots, M = max blocks per slot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from workers.protocol.errors import WorkerBusy

if TYPE_CHECKING:
    from workers.engine.batch import ForwardBatch, KeyRows

NULL_BLOCK = 0  # zeros, read by the padding of short rows; never given to a slot


class OutOfBlocks(WorkerBusy):
    """The pool has fewer free blocks than a forward needs."""


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        max_seq_len: int,
        num_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str,
        block_size: int = 16,
    ):
        self.max_seq_len = max_seq_len  # most cache columns per slot (context + tree room)
        self.num_slots = num_slots
        self.block_size = block_size
        self.num_blocks = -(-num_tokens // block_size) + 1  # and the null block
        shape = (num_layers, num_kv_heads, self.num_blocks * block_size, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)  # (Ly, Hkv, P, D)
        self.v = torch.empty(shape, dtype=dtype, device=device)  # (Ly, Hkv, P, D)
        for pool in (self.k, self.v):
            pool[:, :, :block_size] = 0  # the null block
        self.max_blocks = -(-max_seq_len // block_size)  # M
        # (S, M) long: each slot's blocks in column order; NULL_BLOCK past its last one
        self.tables = torch.full((num_slots, self.max_blocks), NULL_BLOCK, dtype=torch.long)
        self.held = [0] * num_slots  # blocks each slot holds
        self.free = list(range(self.num_blocks - 1, NULL_BLOCK, -1))  # popped lowest first

    @property
    def capacity_tokens(self) -> int:
        """Cache positions sessions can hold in all (the null block aside)."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def used_tokens(self) -> int:
        """Positions in blocks held by slots now."""
        return sum(self.held) * self.block_size

    def blocks_for(self, slot: int, length: int) -> int:
        """More blocks the slot needs to hold `length` columns."""
        return max(0, -(-length // self.block_size) - self.held[slot])

    def reserve(self, slot: int, length: int) -> None:
        """Gives the slot blocks for columns [0, length); raises OutOfBlocks if too few are free."""
        needed = self.blocks_for(slot, length)
        if needed > len(self.free):
            raise OutOfBlocks(
                f"the KV cache has {len(self.free)} free blocks of {self.block_size} tokens, "
                f"a session needs {needed}"
            )
        for _ in range(needed):
            self.tables[slot, self.held[slot]] = self.free.pop()
            self.held[slot] += 1

    def trim(self, slot: int, length: int) -> None:
        """Returns the slot's blocks past column `length`."""
        keep = -(-length // self.block_size)
        while self.held[slot] > keep:
            self.held[slot] -= 1
            self.free.append(int(self.tables[slot, self.held[slot]]))
            self.tables[slot, self.held[slot]] = NULL_BLOCK

    def release(self, slot: int) -> None:
        self.trim(slot, 0)

    def positions(self, slot: int, columns: torch.Tensor) -> torch.Tensor:
        """Pool positions of a slot's cache columns (K,) -> (K,) long."""
        blocks = self.tables[slot, columns // self.block_size]  # (K,)
        return blocks * self.block_size + columns % self.block_size

    def entries(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's first `length` keys and values, every layer: (Ly, Hkv, length, D) each."""
        where = self.positions(slot, torch.arange(length)).to(self.k.device)
        return self.k[:, :, where], self.v[:, :, where]

    def write(self, layer: int, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores the new tokens' k, v (N, Hkv, D) at their pool positions."""
        self.k[layer].index_copy_(1, batch.token_positions, k.transpose(0, 1))
        self.v[layer].index_copy_(1, batch.token_positions, v.transpose(0, 1))

    def read(self, layer: int, rows: KeyRows) -> tuple[torch.Tensor, torch.Tensor]:
        """K key rows of L entries: (K, Hkv, L, D) each, contiguous, gathered from their blocks."""
        out = []
        for pool in (self.k[layer], self.v[layer]):  # (Hkv, P, D)
            hkv, size, d = pool.shape
            gathered = pool.view(hkv * size, d).index_select(0, rows.entries)  # (K * Hkv * L, D)
            out.append(gathered.view(rows.count, hkv, rows.width, d))
        return out[0], out[1]

    def commit(self, slot: int, start: int, keep: list[int]) -> None:
        """Moves entries start + keep[i] to start + i (keep is increasing)."""
        if keep != list(range(len(keep))):
            src = self.positions(slot, torch.tensor(keep) + start).to(self.k.device)
            dst = self.positions(slot, torch.arange(start, start + len(keep))).to(self.k.device)
            for pool in (self.k, self.v):
                pool[:, :, dst] = pool[:, :, src]
        self.trim(slot, start + len(keep))
