"""Automatic prefix caching: full KV blocks shared between sessions by the tokens they hold.

A full block of a session's cached tokens is published under the digest of
every token up to its end (a chain: the previous block's digest and this
block's tokens), as vLLM's automatic prefix caching and SGLang's radix cache
do. A session that starts (or restarts from its history) looks its tokens up
block by block and points its block table at the blocks found: their prefill
is skipped, and it writes only past them. A shared system prompt is prefilled
once per worker, not once per request.

Once no session holds a published block it stays cached, idle, until a block
is wanted and none is free: then the least recently released goes. A session
returns its blocks last first, so a prefix loses its deepest blocks first and
its shared head last.

Digests are SHA-256 (as vLLM's option is): a crafted collision of a weaker
hash would let one request read another's cache.

A session's chain starts from the digest of its cache salt (`root`): the
empty salt is the shared root, and sessions with different salts share no
block. A hit is faster than a miss, so a shared cache tells one client
whether another sent a prefix; the gateway salts by tenant or by request
(`cache_salt`, as vLLM's) where clients must not learn that of each other.

The cached keys and values are those this session would compute itself: the
engine's float32 CPU forward rounds each row the same whatever rows share the
batch (workers/engine/packed.py, tests/engine/test_batch_invariance.py), so a
hit changes no logit there. In other precisions and on GPUs a row's rounding
can depend on its batch, as chunked prefill's does.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

ROOT = b""  # the digest of the empty prefix, unsalted


def root(salt: str) -> bytes:
    """The digest of the empty prefix under `salt` ('' = the shared ROOT)."""
    return hashlib.sha256(b"salt\0" + salt.encode()).digest() if salt else ROOT


def chain(parent: bytes, tokens: list[int]) -> bytes:
    """The digest of the prefix `parent` names followed by `tokens` (one block)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def digests(tokens: list[int], block_size: int, start: bytes = ROOT) -> list[bytes]:
    """The digest of each full block of `tokens`, in order, after the prefix `start` names."""
    out, parent = [], start
    for end in range(block_size, len(tokens) + 1, block_size):
        parent = chain(parent, tokens[end - block_size : end])
        out.append(parent)
    return out


class PrefixIndex:
    """The published blocks by digest, and those no session holds (idle), least recently
    released first."""

    def __init__(self):
        self.blocks: dict[bytes, int] = {}  # digest -> block
        self.digest_of: dict[int, bytes] = {}  # block -> digest
        self.idle: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.blocks)

    def publish(self, digest: bytes, block: int) -> None:
        """Publishes a block under its prefix's digest, unless another block holds it."""
        if digest not in self.blocks and block not in self.digest_of:
            self.blocks[digest] = block
            self.digest_of[block] = digest

    def published(self, block: int) -> bool:
        return block in self.digest_of

    def withdraw(self, block: int) -> None:
        """Forgets a block about to be written or reused."""
        digest = self.digest_of.pop(block, None)
        if digest is not None:
            del self.blocks[digest]
        self.idle.pop(block, None)

    def reclaim(self) -> int:
        """Withdraws the least recently released idle block and returns it."""
        block = next(iter(self.idle))
        self.withdraw(block)
        return block
