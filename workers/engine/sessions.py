"""Sessions of a worker: which KV slot holds which session, and how far it is.

The gateway owns every session's truth (its token history); a worker keeps a
cache of it. Each call names the session, the length of history the caller
believes the worker has (`base_len`) and the tokens committed since. A call
with `base_len == 0` (re)starts the session from the full history, reusing
the cached prefix it shares with what the slot held. Anything else that does
not line up — an unknown, evicted or out-of-sync session — raises
`SessionLost`, and the caller re-sends the history.

Slots are reclaimed by `end`, by `reap_idle` after an idle timeout, and by
least-recently-used eviction when a new session needs a slot. Over a model's
paged KV cache (`attach`), a slot is only a block table: `reserve` gives a
session the blocks its next forward writes, and when too few are free it
evicts the least recently used sessions outside the batch (preemption by
recompute, as vLLM does: they re-send their history) until they are. Where
the cache shares prefixes, a (re)starting session takes the longest run of
published blocks holding its history under its cache salt when that beats
its own slot's, and `advance` publishes the full blocks a session has cached.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from workers.engine.kv_cache import OutOfBlocks
from workers.protocol.errors import SessionLost, WorkerBusy

if TYPE_CHECKING:
    from workers.engine.kv_cache import PagedKVCache


@dataclass
class Session:
    id: str
    slot: int
    committed: list[int] = field(default_factory=list)  # tokens the session has committed
    cached: int = 0  # how many of `committed` sit in the slot's KV cache
    region_tokens: list[int] = field(default_factory=list)  # uncommitted region cached last call
    region_parents: list[int] = field(default_factory=list)  # its tree (-1 = after `cached`)
    region_fed: int = 0  # how many region tokens have keys/values in the cache
    last_used: float = 0.0
    salt: str = ""  # its prefix-cache salt: it shares blocks only with the same salt

    @property
    def pending(self) -> list[int]:
        """Committed tokens whose keys/values are not cached yet."""
        return self.committed[self.cached :]


@dataclass(frozen=True)
class SyncResult:
    session: Session
    prefix_hit: int  # cached tokens reused when a session (re)started from a full history


class SessionTable:
    def __init__(
        self, num_slots: int, idle_timeout_s: float = 600.0, clock: Callable = time.monotonic
    ):
        self.num_slots = num_slots
        self.idle_timeout_s = idle_timeout_s
        self.clock = clock
        self.sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self.free = list(range(num_slots))
        self.evictions = 0
        self.restart_tokens = 0  # history tokens sessions (re)started from
        self.hit_tokens = 0  # of those, tokens already cached
        self.cache: PagedKVCache | None = None  # the KV blocks behind the slots (attach)

    def attach(self, cache: PagedKVCache) -> None:
        """Makes the slots this table hands out block tables of `cache`."""
        if cache.num_slots < self.num_slots:
            raise ValueError(f"{self.num_slots} sessions over a cache of {cache.num_slots} slots")
        self.cache = cache

    def __len__(self) -> int:
        return len(self.sessions)

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionLost(f"session {session_id!r} is not held by this worker")
        return session

    def sync(
        self,
        session_id: str,
        base_len: int,
        tokens: list[int],
        busy: set[str] = frozenset(),
        rollback: bool = False,
        salt: str = "",
        reuse: int | None = None,
    ) -> SyncResult:
        """Brings a session up to `base_len` + `tokens`; see the module docstring.

        With `rollback`, a session holding more than `base_len` tokens first
        drops the tokens past it: a draft's history may run ahead on a guess
        (the gateway's overlapped loop), and a draft cannot affect the output.
        `reuse` bounds the tokens of cached KV, its own or shared, that a
        (re)started session may take instead of feeding them (None: no bound; 0:
        it feeds its whole history).
        """
        if base_len == 0:
            return self.restart(session_id, tokens, busy, salt, reuse)
        session = self.get(session_id)
        if rollback and len(session.committed) > base_len:
            del session.committed[base_len:]
            if session.cached > base_len:  # the cached region no longer lines up
                self.rewind(session, base_len)
                session.region_tokens, session.region_parents, session.region_fed = [], [], 0
        if len(session.committed) != base_len:
            raise SessionLost(
                f"session {session_id!r} holds {len(session.committed)} tokens, "
                f"the caller expected {base_len}"
            )
        session.committed.extend(tokens)
        self.touch(session)
        return SyncResult(session, 0)

    def restart(
        self,
        session_id: str,
        history: list[int],
        busy: set[str],
        salt: str = "",
        reuse: int | None = None,
    ) -> SyncResult:
        if not history:
            raise ValueError("a session cannot start from an empty history")
        session = self.sessions.get(session_id)
        if session is None:
            session = Session(session_id, self.allocate(busy))
            self.sessions[session_id] = session
        # the last token is fed again for its logits
        most = len(history) - 1 if reuse is None else min(reuse, len(history) - 1)
        hit = min(common_prefix(session.committed[: session.cached], history), most)
        if session.salt != salt:  # under another salt, none of it is its own
            hit = 0
        if self.cache is not None and most > 0:
            hit = self.cache.adopt(session.slot, history, hit, salt, most)
        elif self.cache is not None:  # no shared blocks either
            hit = self.cache.rewind(session.slot, 0)
        session.committed, session.cached, session.salt = list(history), hit, salt
        self.restart_tokens += len(history)
        self.hit_tokens += hit
        session.region_tokens, session.region_parents, session.region_fed = [], [], 0
        self.touch(session)
        return SyncResult(session, hit)

    def allocate(self, busy: set[str]) -> int:
        if self.free:
            return self.free.pop(0)
        for victim in self.sessions.values():
            if victim.id not in busy:
                self.end(victim.id)
                self.evictions += 1
                return self.free.pop(0)
        raise WorkerBusy(f"all {self.num_slots} session slots are busy")

    def reserve(self, session: Session, length: int, busy: Collection[str]) -> None:
        """Gives the session's slot KV blocks for `length` columns; see the module docstring.
        Raises OutOfBlocks (a WorkerBusy) when even that frees too few."""
        cache = self.cache
        while True:
            try:
                cache.reserve(session.slot, length)
                return
            except OutOfBlocks:
                victim = next(
                    (
                        s
                        for s in self.sessions.values()
                        if s.id not in busy and s is not session and cache.held[s.slot]
                    ),
                    None,
                )
                if victim is None:
                    raise
                self.end(victim.id)
                self.evictions += 1

    def advance(self, session: Session, n: int) -> None:
        """Counts `n` more of the session's committed tokens as cached, and publishes the full
        blocks they complete where the cache shares prefixes."""
        session.cached += n
        if self.cache is not None:
            self.cache.publish(session.slot, session.committed, session.cached, session.salt)

    def rewind(self, session: Session, length: int) -> None:
        """Sets the session's cached length back to `length` or, where its KV blocks are
        shared at that point (workers/engine/kv_cache.py), to the block boundary before."""
        session.cached = length if self.cache is None else self.cache.rewind(session.slot, length)

    def touch(self, session: Session) -> None:
        session.last_used = self.clock()
        self.sessions.move_to_end(session.id)

    def end(self, session_id: str) -> bool:
        session = self.sessions.pop(session_id, None)
        if session is None:
            return False
        self.free.append(session.slot)
        if self.cache is not None:
            self.cache.release(session.slot)
        return True

    def reap_idle(self) -> list[str]:
        """Ends sessions idle for longer than the timeout; returns their ids."""
        limit = self.clock() - self.idle_timeout_s
        idle = [s.id for s in self.sessions.values() if s.last_used < limit]
        for session_id in idle:
            self.end(session_id)
        return idle


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
