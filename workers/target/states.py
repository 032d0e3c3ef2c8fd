"""The target's hidden states of shared prompt prefixes, kept beside the prefix cache.

A feature draft needs the target's state at every position of a session's
history, and cached KV holds none: without these, a session that asks for
states would have to feed its whole prompt even where another session left
its prefix's blocks in the prefix cache (workers/engine/prefix_cache.py). So
the target keeps the states of every full KV block a feature session's
answers covered (its prompt, then its answer block by block: a session's
states short of a full block wait in its tail until the next answers complete
it), under the block's prefix digest (the same chain as the prefix cache,
salted alike), least recently used first out, within a byte budget. A feature
session that (re)starts takes cached KV only as far as these states reach
(a conversation's next turn, its earlier turns), and its answer begins with
them.

The states of a prefix are those the session would compute itself wherever the
prefix's KV is (batch-invariant products, float32 on the CPU); in other
precisions they may round differently, as reused KV may. Either way they only
feed the draft: a stale or missing state costs acceptance, never a token.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from workers.engine.prefix_cache import digests, root

# the default budget (a worker's --prefix-state-mib): 58,254 positions of a 576-wide model
STATE_BYTES = 64 << 20


class PrefixStates:
    """States (block_size, E) by the digest of the prefix their block ends, LRU."""

    def __init__(self, block_size: int, max_bytes: int = STATE_BYTES, max_tails: int = 64):
        self.block_size = block_size
        self.max_bytes = max_bytes
        self.blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.bytes = 0
        # per session: the states past its last full block, (first position, (T, E)), T <
        # block_size; the most recently extended `max_tails` (a session evicted or reaped
        # leaves its tail behind until newer ones push it out)
        self.tails: OrderedDict[str, tuple[int, torch.Tensor]] = OrderedDict()
        self.max_tails = max_tails

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

    def keep(
        self, session: str, history: list[int], salt: str, start: int, states: torch.Tensor
    ) -> None:
        """Keeps the states (R, E) of positions start .. start + R - 1 of `history` (the
        session's answer), with its tail before them where they follow on: those of each
        full block they cover; what is left past the last becomes the session's tail."""
        tail = self.tails.pop(session, None)
        if tail is not None and tail[0] + len(tail[1]) == start:
            start, states = tail[0], torch.cat([tail[1], states])
        end = start + len(states)
        first = -(-start // self.block_size)  # the first block starting at or after start
        last = end // self.block_size  # blocks before this one end by `end`
        if first < last:
            chain = digests(history[: last * self.block_size], self.block_size, root(salt))
            for b in range(first, last):
                self.add(
                    chain[b],
                    states[b * self.block_size - start : (b + 1) * self.block_size - start],
                )
        rest = max(start, last * self.block_size)
        if rest < end:
            self.tails[session] = (rest, states[rest - start :].clone())
            while len(self.tails) > self.max_tails:
                self.tails.popitem(last=False)

    def add(self, digest: bytes, rows: torch.Tensor) -> None:
        """One block's states (block_size, E), the least recently used out past the budget."""
        if digest in self.blocks:
            self.blocks.move_to_end(digest)
            return
        self.blocks[digest] = rows.clone()  # not a view pinning the whole answer
        self.bytes += rows.numel() * rows.element_size()
        while self.bytes > self.max_bytes and self.blocks:
            _, dropped = self.blocks.popitem(last=False)
            self.bytes -= dropped.numel() * dropped.element_size()

    def forget(self, session: str) -> None:
        """Drops an ended session's tail."""
        self.tails.pop(session, None)
