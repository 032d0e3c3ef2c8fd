"""A suffix cache: recent outputs of a tenant's requests, for the n-gram drafter.

Prompt lookup (workers/speculation/ngram.py) only copies from the session's
own history. Many requests repeat what other requests produced: users ask
the same questions in other words, an agent re-emits the file it edits. This
cache keeps each tenant's recent finished outputs (each with the last
`context` tokens of its prompt, so that the start of an answer is found after
the chat template's "assistant" turn) and finds the continuations of the
current suffix in them, as vLLM's suffix decoding and SGLang's global trie do
within one engine.

- Tenants are isolated: a lookup only sees the outputs of its own tenant
  (the gateway's hash of the API key; requests without a key share one).
- Memory is bounded: at most `tokens_per_tenant` tokens per tenant (the
  oldest outputs go first) and `max_tenants` tenants (the least recently used
  goes first), so never more than their product.
- A lookup costs O(matches): an index maps each `key_len`-gram to the places
  it occurs, most recent last; the newest `max_scan` of them are extended
  backwards to find how long each match is, and the longest matches win.

It is not thread-safe: the gateway uses it from its event loop only.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SuffixCacheConfig:
    tokens_per_tenant: int = 65_536  # most cached tokens of one tenant; older outputs go first
    max_tenants: int = 256  # most tenants cached; the least recently used goes first
    context: int = 16  # prompt tokens kept before each output (where an answer starts)
    key_len: int = 3  # tokens a match must share at least (the index's n-gram length)
    max_match: int = 32  # longest match measured (longer ones rank the same)
    max_scan: int = 64  # most recent occurrences of the key examined per lookup
    matches: int = 4  # most continuations a lookup returns

    def __post_init__(self):
        if self.tokens_per_tenant < 1 or self.max_tenants < 1 or self.context < 0:
            raise ValueError("need tokens_per_tenant >= 1, max_tenants >= 1 and context >= 0")
        if not 1 <= self.key_len <= self.max_match or self.max_scan < 1 or self.matches < 1:
            raise ValueError("need 1 <= key_len <= max_match, max_scan >= 1 and matches >= 1")


def tenant_of(api_key: str | None) -> str:
    """The tenant of a request: a hash of its API key ('' for requests without one)."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:32] if api_key else ""


@dataclass
class _Tenant:
    """One tenant's outputs and the index over them."""

    outputs: OrderedDict[int, list[int]] = field(default_factory=OrderedDict)  # id -> tokens
    # key_len-gram -> (output id, position of its last token), oldest first
    index: dict[tuple[int, ...], deque[tuple[int, int]]] = field(default_factory=dict)
    size: int = 0  # tokens in outputs
    next_id: int = 0


class SuffixCache:
    """Each tenant's recent outputs; `continuations` finds what followed a suffix in them."""

    def __init__(self, config: SuffixCacheConfig = SuffixCacheConfig()):
        self.config = config
        self.tenants: OrderedDict[str, _Tenant] = OrderedDict()  # least recently used first

    @property
    def size(self) -> int:
        """Tokens cached, over all tenants."""
        return sum(t.size for t in self.tenants.values())

    def add(self, tenant: str, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Caches an output (after the tail of its prompt) for the tenant's later requests."""
        c = self.config
        tokens = (list(prompt[-c.context :]) if c.context else []) + list(output)
        tokens = tokens[-c.tokens_per_tenant :]
        if not output or len(tokens) <= c.key_len:
            return
        entry = self._touch(tenant)
        while entry.size + len(tokens) > c.tokens_per_tenant:
            self._evict_oldest(entry)
        out_id = entry.next_id
        entry.next_id += 1
        entry.outputs[out_id] = tokens
        entry.size += len(tokens)
        for end in range(c.key_len - 1, len(tokens) - 1):  # a key must have a next token
            key = tuple(tokens[end - c.key_len + 1 : end + 1])
            entry.index.setdefault(key, deque()).append((out_id, end))
        while len(self.tenants) > c.max_tenants:
            self.tenants.popitem(last=False)

    def continuations(self, tenant: str, history: Sequence[int], depth: int) -> list[list[int]]:
        """Up to `config.matches` runs of `depth` tokens that followed the history's suffix in
        the tenant's outputs: longest match first, then most recent."""
        c = self.config
        entry = self.tenants.get(tenant)
        if entry is None or len(history) < c.key_len or depth < 1:
            return []
        self.tenants.move_to_end(tenant)
        places = entry.index.get(tuple(history[-c.key_len :]))
        if not places:
            return []
        found: list[tuple[int, int, list[int]]] = []  # (-match length, age rank, continuation)
        for rank, (out_id, end) in enumerate(reversed(places)):
            if rank == c.max_scan:
                break
            tokens = entry.outputs[out_id]
            length = c.key_len  # the key matched; extend backwards
            while (
                length < c.max_match
                and length < len(history)
                and end - length >= 0
                and tokens[end - length] == history[-1 - length]
            ):
                length += 1
            found.append((-length, rank, tokens[end + 1 : end + 1 + depth]))
        found.sort(key=lambda f: (f[0], f[1]))
        return [cont for _, _, cont in found[: c.matches]]

    def _touch(self, tenant: str) -> _Tenant:
        entry = self.tenants.get(tenant)
        if entry is None:
            entry = self.tenants[tenant] = _Tenant()
        self.tenants.move_to_end(tenant)
        return entry

    def _evict_oldest(self, entry: _Tenant) -> None:
        """Drops the tenant's oldest output; its index entries are the oldest of their keys."""
        k = self.config.key_len
        out_id, tokens = entry.outputs.popitem(last=False)
        entry.size -= len(tokens)
        for end in range(k - 1, len(tokens) - 1):
            key = tuple(tokens[end - k + 1 : end + 1])
            places = entry.index[key]
            places.popleft()
            if not places:
                del entry.index[key]
