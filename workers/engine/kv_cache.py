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

With `share_prefixes`, full blocks of committed tokens are shared between
sessions by their tokens (workers/engine/prefix_cache.py): `publish` offers
a slot's, `adopt` points a starting slot at those matching its history, and
a block stays cached after its last slot returns it, until the pool needs
it. A slot writes only into blocks it holds alone and has not published:
`rewind` keeps that true when a slot's cached length goes back.

The pool is allocated empty (`torch.empty`): a block costs resident memory
only once a session has written to it.

Shapes: Ly layers, Hkv key/value heads, P pool positions, D head size,
S slots, M = max blocks per slot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from workers.engine.prefix_cache import PrefixIndex, digests, root
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
        share_prefixes: bool = False,
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
        self.refs = [0] * self.num_blocks  # slots holding each block
        self.prefixes = PrefixIndex() if share_prefixes else None
        # each slot's leading full blocks' digests, as far as `publish` or `adopt` went
        self.chains: list[list[bytes]] = [[] for _ in range(num_slots)]

    @property
    def capacity_tokens(self) -> int:
        """Cache positions sessions can hold in all (the null block aside)."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def available(self) -> int:
        """Blocks a slot can take: the free ones and the cached ones no slot holds."""
        return len(self.free) + (len(self.prefixes.idle) if self.prefixes is not None else 0)

    @property
    def used_tokens(self) -> int:
        """Positions in blocks held by slots now."""
        return (self.num_blocks - 1 - self.available) * self.block_size

    @property
    def cached_tokens(self) -> int:
        """Positions in published blocks, held or idle."""
        return len(self.prefixes) * self.block_size if self.prefixes is not None else 0

    def blocks_for(self, slot: int, length: int) -> int:
        """More blocks the slot needs to hold `length` columns."""
        return max(0, -(-length // self.block_size) - self.held[slot])

    def reserve(self, slot: int, length: int) -> None:
        """Gives the slot blocks for columns [0, length); raises OutOfBlocks if too few are
        free (idle cached blocks count as free: the least recently released go first)."""
        needed = self.blocks_for(slot, length)
        if needed > self.available:
            raise OutOfBlocks(
                f"the KV cache has {self.available} free blocks of {self.block_size} tokens, "
                f"a session needs {needed}"
            )
        for _ in range(needed):
            block = self.free.pop() if self.free else self.prefixes.reclaim()
            self.hold(slot, block)

    def hold(self, slot: int, block: int) -> None:
        """Appends a block to the slot's table."""
        if self.prefixes is not None:
            self.prefixes.idle.pop(block, None)
        self.refs[block] += 1
        self.tables[slot, self.held[slot]] = block
        self.held[slot] += 1

    def trim(self, slot: int, length: int) -> None:
        """Returns the slot's blocks past column `length`."""
        keep = -(-length // self.block_size)
        del self.chains[slot][length // self.block_size :]
        while self.held[slot] > keep:
            self.held[slot] -= 1
            block = int(self.tables[slot, self.held[slot]])
            self.tables[slot, self.held[slot]] = NULL_BLOCK
            self.refs[block] -= 1
            if self.refs[block]:
                continue
            if self.prefixes is not None and self.prefixes.published(block):
                self.prefixes.idle[block] = None
            else:
                self.free.append(block)

    def release(self, slot: int) -> None:
        self.trim(slot, 0)

    def publish(self, slot: int, tokens: list[int], length: int, salt: str = "") -> None:
        """Publishes the slot's full blocks within its first `length` columns, which hold
        the keys and values of `tokens[:length]`, under the salt the slot started with."""
        if self.prefixes is None:
            return
        known, size = self.chains[slot], self.block_size
        first = len(known)  # the first block not published yet
        new = digests(tokens[first * size : length], size, known[-1] if known else root(salt))
        for block, digest in enumerate(new, start=first):
            self.prefixes.publish(digest, int(self.tables[slot, block]))
        known += new

    def adopt(
        self, slot: int, tokens: list[int], hit: int, salt: str = "", most: int | None = None
    ) -> int:
        """Starts the slot over `tokens`, keeping the first `hit` columns it holds, or instead
        taking the longest run of published blocks holding a prefix of `tokens[:-1]` (of its
        first `most` tokens, where given) under `salt` where that is longer; returns the
        columns cached. A slot whose salt changes keeps none of its own (the caller passes
        `hit` 0)."""
        found: list[tuple[bytes, int]] = []
        if self.prefixes is not None:
            for digest in digests(tokens[:-1][:most], self.block_size, root(salt)):
                block = self.prefixes.blocks.get(digest)
                if block is None:
                    break
                found.append((digest, block))
        if len(found) * self.block_size <= hit:
            return self.rewind(slot, hit)
        self.release(slot)
        for digest, block in found:
            self.hold(slot, block)
            self.chains[slot].append(digest)
        return len(found) * self.block_size

    def rewind(self, slot: int, length: int) -> int:
        """Cuts the slot back to its first `length` columns, to be written past them; returns
        the columns it keeps: fewer, back to a block boundary, where column `length` lies in a
        block another slot holds too."""
        self.trim(slot, length)
        if self.prefixes is not None and length % self.block_size:
            block = int(self.tables[slot, length // self.block_size])
            if self.refs[block] > 1:
                length -= length % self.block_size
                self.trim(slot, length)
            else:
                self.prefixes.withdraw(block)
        return length

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
