"""A preallocated, slot-based KV cache.

Every session owns a slot: a row of `max_seq_len` positions in every layer.
A forward writes its new tokens' keys and values at explicit cache indices and
reads each slot's entries back up to the longest row of its row group. Rejected
speculation needs no undo: committing keeps the accepted entries (moved to
contiguous indices) and whatever lies beyond the committed length is simply
overwritten by the next forward (gpt-fast's trick).

Shapes: Ly layers, S slots, Hkv key/value heads, C = max_seq_len cache
columns, D head size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from workers.engine.batch import ForwardBatch, RowGroup


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
        shape = (num_layers, num_slots, num_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (Ly, S, Hkv, C, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # (Ly, S, Hkv, C, D)

    def write(self, layer: int, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores the new tokens' k, v (N, Hkv, D) at their slots and columns."""
        keys, values = self.k[layer], self.v[layer]  # (S, Hkv, C, D)
        keys[batch.token_slots, :, batch.token_columns] = k
        values[batch.token_slots, :, batch.token_columns] = v

    def read(self, layer: int, group: RowGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's first L entries: (G, Hkv, L, D) each (a view for a group of one)."""
        keys = self.k[layer, :, :, : group.width]  # (S, Hkv, L, D)
        values = self.v[layer, :, :, : group.width]
        if len(group.slots) == 1:
            slot = int(group.slots[0])
            return keys[slot][None], values[slot][None]
        return keys.index_select(0, group.slots), values.index_select(0, group.slots)

    def commit(self, slot: int, start: int, keep: list[int]) -> None:
        """Moves entries start + keep[i] to start + i (keep is increasing)."""
        if keep == list(range(len(keep))):
            return
        src = torch.tensor(keep, device=self.k.device) + start
        dst = torch.arange(start, start + len(keep), device=self.k.device)
        for cache in (self.k, self.v):
            rows = cache[:, slot]  # (Ly, Hkv, C, D), a view
            rows[:, :, dst] = rows[:, :, src]
