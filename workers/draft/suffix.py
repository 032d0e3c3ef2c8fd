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
  goes first), so never more than their product. A cached token costs about
  250 bytes at most (every n-gram distinct): the defaults hold at most
  16,384 x 32 tokens, about 130 MB.
- A lookup costs O(matches): an index maps each `key_len`-gram to the places
  it occurs, most recent last; the newest `max_scan` of them are extended
  backwards to find how long each match is, and the longest matches win.

It is not thread-safe: the gateway uses it from its event loop only.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SuffixCacheConfig:
    tokens_per_tenant: int = 16_384  # most cached tokens of one tenant; older outputs go first
    max_tenants: int = 32  # most tenants cached; the least recently used goes first
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


SEP = -1  # after each cached output: no match extends or continues across it


def _key(gram: Sequence[int]) -> int:
    """The index's key of an n-gram (a hash: a lookup checks the tokens themselves)."""
    return hash(tuple(gram))


@dataclass
class _Tenant:
    """One tenant's outputs in one flat array, and the index over them.

    Positions are global: tokens[i] is position base + i, so evicting the
    oldest output (the front of the array) leaves every other position valid."""

    tokens: array = field(default_factory=lambda: array("l"))  # outputs, each then SEP
    base: int = 0  # global position of tokens[0]
    lengths: deque[int] = field(default_factory=deque)  # each output's length + 1, oldest first
    index: dict[int, list[int]] = field(default_factory=dict)  # key -> its last tokens' positions

    @property
    def size(self) -> int:
        return len(self.tokens)

    def add(self, seq: list[int], key_len: int) -> None:
        start = self.base + len(self.tokens)
        self.tokens.extend(seq)
        self.tokens.append(SEP)
        self.lengths.append(len(seq) + 1)
        for end in range(key_len - 1, len(seq) - 1):  # a key must have a next token
            self.index.setdefault(_key(seq[end - key_len + 1 : end + 1]), []).append(start + end)

    def evict_oldest(self, key_len: int) -> None:
        """Drops the oldest output; its places are the first of their keys' lists."""
        n = self.lengths.popleft()
        seq = self.tokens[: n - 1]
        for end in range(key_len - 1, len(seq) - 1):
            key = _key(seq[end - key_len + 1 : end + 1])
            places = self.index[key]
            del places[0]
            if not places:
                del self.index[key]
        del self.tokens[:n]
        self.base += n


class SuffixCache:
    """Each tenant's recent outputs; `continuations` finds what followed a suffix in them."""

    def __init__(self, config: SuffixCacheConfig = SuffixCacheConfig()):
        self.config = config
        self.tenants: OrderedDict[str, _Tenant] = OrderedDict()  # least recently used first

    @property
    def size(self) -> int:
        """Tokens cached (with one separator per output), over all tenants."""
        return sum(t.size for t in self.tenants.values())

    def add(self, tenant: str, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Caches an output (after the tail of its prompt) for the tenant's later requests."""
        c = self.config
        seq = (list(prompt[-c.context :]) if c.context else []) + list(output)
        seq = seq[-(c.tokens_per_tenant - 1) :] if c.tokens_per_tenant > 1 else []
        if not output or len(seq) <= c.key_len:
            return
        entry = self.tenants.get(tenant)
        if entry is None:
            entry = self.tenants[tenant] = _Tenant()
        self.tenants.move_to_end(tenant)
        while entry.size + len(seq) + 1 > c.tokens_per_tenant:
            entry.evict_oldest(c.key_len)
        entry.add(seq, c.key_len)
        while len(self.tenants) > c.max_tenants:
            self.tenants.popitem(last=False)

    def continuations(self, tenant: str, history: Sequence[int], depth: int) -> list[list[int]]:
        """Up to `config.matches` runs of at most `depth` tokens that followed the history's
        suffix in the tenant's outputs: longest match first, then most recent."""
        c = self.config
        entry = self.tenants.get(tenant)
        if entry is None or len(history) < c.key_len or depth < 1:
            return []
        self.tenants.move_to_end(tenant)
        places = entry.index.get(_key(history[-c.key_len :]), [])
        tokens = entry.tokens
        found: list[tuple[int, int, list[int]]] = []  # (-match length, age rank, continuation)
        for rank, place in enumerate(reversed(places[-c.max_scan :])):
            at = place - entry.base
            length = 0  # how many tokens up to `at` equal the history's last ones
            while (
                length < c.max_match
                and length < len(history)
                and at - length >= 0
                and tokens[at - length] == history[-1 - length]
            ):
                length += 1
            if length < c.key_len:  # a hash collision
                continue
            cont = tokens[at + 1 : at + 1 + depth].tolist()
            if SEP in cont:
                cont = cont[: cont.index(SEP)]
            found.append((-length, rank, cont))
        found.sort(key=lambda f: (f[0], f[1]))
        return [cont for _, _, cont in found[: c.matches]]
