"""The target's hidden states of shared prompt prefixes, kept beside the prefix cache.

A feature draft needs the target's state at every position of a session's
history, and cached KV holds none: without these, a session that asks for
states would have to feed its whole prompt even where another session left
its prefix's blocks in the prefix cache (workers/engine/prefix_cache.py). So
the target keeps the states of every full KV block a feature session's answer
covered (its prompt, mostly), under the block's prefix digest (the same chain
as the prefix cache, salted alike), least recently used first out, within a
byte budget. A feature session that (re)starts takes cached KV only as far as
these states reach, and its answer begins with them.

The states of a prefix are those the session would compute itself wherever the
prefix's KV is (batch-invariant products, float32 on the CPU); in other
precisions they may round differently, as reused KV may. Either way they only
feed the draft: a stale or missing state costs acceptance, never a token.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from workers.engine.prefix_cache import digests, root

STATE_BYTES = 64 << 20  # the default budget: 58,254 positions of a 576-wide model in bf16


class PrefixStates:
    """States (block_size, E) by the digest of the prefix their block ends, LRU."""

    def __init__(self, block_size: int, max_bytes: int = STATE_BYTES):
        self.block_size = block_size
        self.max_bytes = max_bytes
        self.blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.bytes = 0

    def known(self, history: list[int], salt: str) -> int:
        """How many leading tokens of `history` (all but its last, which is always fed) have
        their states kept: whole blocks, from the start."""
        held = 0
        for digest in digests(history[:-1], self.block_size, root(salt)):
            if digest not in self.blocks:
                break
            self.blocks.move_to_end(digest)
            held += self.block_size
        return held

    def rows(self, history: list[int], salt: str, count: int) -> torch.Tensor:
        """The kept states of the first `count` positions of `history` (`known` covers them):
        (count, E)."""
        chain = digests(history[: count + self.block_size - 1], self.block_size, root(salt))
        return torch.cat([self.blocks[d] for d in chain])[:count]

    def keep(self, history: list[int], salt: str, start: int, states: torch.Tensor) -> None:
        """Keeps the states (R, E) of positions start .. start + R - 1 of `history`, those of
        each full block they cover."""
        end = start + len(states)
        first = -(-start // self.block_size)  # the first block starting at or after start
        last = end // self.block_size  # blocks before this one end by `end`
        if first >= last:
            return
        chain = digests(history[: last * self.block_size], self.block_size, root(salt))
        for b in range(first, last):
            if chain[b] in self.blocks:
                self.blocks.move_to_end(chain[b])
                continue
            rows = states[b * self.block_size - start : (b + 1) * self.block_size - start]
            self.blocks[chain[b]] = rows.clone()  # not a view pinning the whole answer
            self.bytes += rows.numel() * rows.element_size()
        while self.bytes > self.max_bytes and self.blocks:
            _, dropped = self.blocks.popitem(last=False)
            self.bytes -= dropped.numel() * dropped.element_size()
