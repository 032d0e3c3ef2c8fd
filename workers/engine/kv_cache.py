"""A preallocated, slot-based KV cache.

Every session owns a slot: a row of `max_seq_len` positions in every layer.
A forward writes its new tokens' keys and values at explicit cache indices and
reads each slot's entries back up to the longest row of the batch. Rejected
speculation needs no undo: committing keeps the accepted entries (moved to
contiguous indices) and whatever lies beyond the committed length is simply
overwritten by the next forward (gpt-fast's trick).

Shapes: Ly layers, S slots, Hkv key/value heads, C = max_seq_len + 1 cache
columns (the last one is scratch that absorbs the writes of batch padding),
D head size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from workers.engine.llama import ForwardBatch


class SlotKVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        max_seq_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.max_seq_len = max_seq_len
        self.num_slots = num_slots
        self.scratch = max_seq_len  # cache column that padding writes land in
        shape = (num_layers, num_slots, num_kv_heads, max_seq_len + 1, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (Ly, S, Hkv, C, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # (Ly, S, Hkv, C, D)

    def write_and_read(
        self, layer: int, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores k, v (B, Hkv, T, D) at each row's write indices; returns (B, Hkv, L, D) each."""
        keys, values = self.k[layer], self.v[layer]  # (S, Hkv, C, D)
        width = batch.mask.shape[-1]  # L
        if len(batch.lengths) == 1:
            slot, start, t = int(batch.slots[0]), int(batch.write_at[0]), k.shape[2]
            keys[slot, :, start : start + t] = k[0]
            values[slot, :, start : start + t] = v[0]
            return keys[slot, :, :width][None], values[slot, :, :width][None]
        index = self.write_index(batch)  # (B, T)
        rows = batch.slots[:, None]  # (B, 1)
        keys[rows, :, index] = k.transpose(1, 2)  # (B, T, Hkv, D) into (S, Hkv, C, D)
        values[rows, :, index] = v.transpose(1, 2)
        return keys[batch.slots, :, :width], values[batch.slots, :, :width]

    def write_index(self, batch: ForwardBatch) -> torch.Tensor:
        # (B, T): cache column of every new token; padding goes to the scratch column
        t = batch.width
        offsets = torch.arange(t, device=batch.tokens.device)  # (T,)
        lengths = torch.tensor(batch.lengths, device=batch.tokens.device)  # (B,)
        index = batch.write_at[:, None] + offsets  # (B, T)
        return torch.where(offsets < lengths[:, None], index, self.scratch)

    def commit(self, slot: int, start: int, keep: list[int]) -> None:
        """Moves entries start + keep[i] to start + i (keep is increasing)."""
        if keep == list(range(len(keep))):
            return
        src = torch.tensor(keep, device=self.k.device) + start
        dst = torch.arange(start, start + len(keep), device=self.k.device)
        for cache in (self.k, self.v):
            rows = cache[:, slot]  # (Ly, Hkv, C, D), a view
            rows[:, :, dst] = rows[:, :, src]

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Copies the first `length` entries of one slot into another (prefix reuse)."""
        for cache in (self.k, self.v):
            cache[:, dst_slot, :, :length] = cache[:, src_slot, :, :length]
