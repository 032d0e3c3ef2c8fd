"""Worker pools and the router that pairs each choice with a draft and a target.

A `Pool` holds the workers of one role. Its addresses are host:port pairs; a
DNS name is re-resolved every `dns_refresh_s` and stands for every address it
resolves to (a Kubernetes headless Service lists one address per pod), so pods
that come and go join and leave the pool. Every worker is health-checked every
`health_interval_s`; a call that fails (or hangs, gateway/hangs.py) marks it
down at once, and the next passing check brings it back.

The `Router` counts live choices against capacity (503 with no healthy target;
gateway/admission.py queues the requests beyond it), picks the least loaded
healthy worker of a role, and keeps a conversation (X-Session-ID header or
`user`) on the workers that served it before, under the same worker session
id, so a target finds the conversation's prefix still in its KV cache.

Without a conversation key a session goes by its prompt (prefix-aware
routing, as SGLang's cache-aware router and vLLM's production stack do):
the router remembers which worker each full block of a recent prompt went
to, by the digest chain the workers' prefix cache uses (salted alike), and
sends a new session to the worker that got the longest prefix of its
prompt, if that prefix is more than half of the prompt's blocks and that
worker has at most `prefix_slack` live sessions above the least loaded one.
The next turn of a conversation, whose prompt opens with the last one's,
and requests sharing a long system prompt land where the prefix is cached
instead of prefilling it on every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import logging
import math
import socket
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.adaptive import AdaptiveConfig, CostFit
from gateway.epochs import Epochs
from gateway.errors import APIError
from gateway.hangs import CallTimes
from gateway.metrics import Metrics
from workers.engine.prefix_cache import digests, root
from workers.protocol import Backend, BackendFactory, Role, WorkerInfo

log = logging.getLogger("specsplit.gateway")

CALL_TIMEOUT_S = 5.0  # health, info and end calls
PREFIX_BLOCK = 16  # tokens per block prefix-aware routing keys on (the workers' KV block)


def prompt_blocks(prompt: list[int], salt: str) -> tuple[bytes, ...]:
    """The routing keys of a prompt: the digests of its full blocks (those a worker's
    prefix cache could hold: the last token is always fed), salted as the workers salt."""
    return tuple(digests(prompt[:-1], PREFIX_BLOCK, root(salt)))


@dataclass(eq=False)
class Worker:
    role: Role
    address: str
    backend: Backend
    up: bool = False  # passed its last health check and no call failed since
    info: WorkerInfo | None = None
    compatible: bool = True  # its tokenizer matches the gateway's
    load: int = 0  # choices bound to it now
    picks: int = 0  # choices ever bound to it (breaks ties in least-loaded picks)
    ever_up: bool = False
    times: CallTimes = field(default_factory=CallTimes)  # its recent calls (gateway.hangs)
    cost: CostFit = field(default_factory=CostFit)  # a target's round cost (gateway.adaptive)
    epochs: Epochs = field(default_factory=Epochs)  # a target's drafting and plain epochs

    @property
    def serving(self) -> bool:
        return self.up and self.compatible

    @property
    def max_tree_nodes(self) -> int:
        """Most nodes it verifies in one tree; 0 = no limit stated (or not known yet)."""
        return self.info.max_tree_nodes if self.info else 0

    @property
    def feature_size(self) -> int:
        """A feature draft: the width of the target states it feeds on; else 0."""
        return self.info.feature_size if self.info else 0

    @property
    def lookup_rows(self) -> int | None:
        """A target: the rows a forward computes about as cheaply as its first, which decode
        steps' own lookups may fill; None = not stated (or not known yet)."""
        return self.info.lookup_rows if self.info else None

    @property
    def capacity(self) -> float:
        sessions = self.info.max_sessions if self.info else 0
        return sessions if sessions > 0 else math.inf


def split_addresses(addresses: str) -> list[str]:
    return [a.strip() for a in addresses.split(",") if a.strip()]


async def resolve_address(address: str) -> list[str]:
    """host:port -> one host:port per address the name resolves to (IPv4 first).

    IP literals and names without a numeric port (in-process workers) are
    returned as they are; a name that does not resolve raises OSError.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        return [address]
    host = host.strip("[]")
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(host)
        return [address]
    infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    v4 = sorted({i[4][0] for i in infos if i[0] == socket.AF_INET})
    v6 = sorted({i[4][0] for i in infos if i[0] == socket.AF_INET6})
    return [f"{ip}:{port}" for ip in v4] or [f"[{ip}]:{port}" for ip in v6]


class Pool:
    def __init__(
        self,
        role: Role,
        addresses: list[str],
        factory: BackendFactory,
        metrics: Metrics,
        fingerprint: str = "",
        health_interval_s: float = 2.0,
        dns_refresh_s: float = 30.0,
        resolver=resolve_address,
        adaptive: AdaptiveConfig | None = None,
    ):
        self.role = role
        self.addresses = addresses  # as configured (names or host:port)
        self.factory = factory
        self.metrics = metrics
        self.fingerprint = fingerprint  # the gateway tokenizer's; "" = accept any worker
        self.health_interval_s = health_interval_s
        self.dns_refresh_s = dns_refresh_s
        self.resolver = resolver
        # the adaptive trees' config: each health check exports a target's round cost as
        # they read it (`Metrics.observe_round_cost`); None: not exported (fixed trees)
        self.adaptive = adaptive
        self.resolved: dict[str, list[str]] = {}  # configured address -> last resolution
        self.workers: dict[str, Worker] = {}
        self.task: asyncio.Task | None = None

    def serving(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.serving]

    async def start(self) -> None:
        await self.refresh()
        await self.check_all()
        self.task = asyncio.create_task(self.watch(), name=f"pool-{self.role}")

    async def watch(self) -> None:
        last_refresh = time.monotonic()
        while True:
            await asyncio.sleep(self.health_interval_s)
            if self.dns_refresh_s > 0 and time.monotonic() - last_refresh >= self.dns_refresh_s:
                last_refresh = time.monotonic()
                await self.refresh()
            await self.check_all()

    async def refresh(self) -> None:
        """Re-resolves the configured addresses; adds and removes workers to match."""
        wanted: list[str] = []
        for address in self.addresses:
            try:
                self.resolved[address] = await self.resolver(address)
            except OSError as error:
                log.warning("%s %s does not resolve: %s", self.role, address, error)
                self.resolved.setdefault(address, [address])  # let the backend try it
            wanted += [a for a in self.resolved[address] if a not in wanted]
        for address in wanted:
            if address not in self.workers:
                self.workers[address] = Worker(self.role, address, self.factory(self.role, address))
                log.info("%s worker %s joined the pool", self.role, address)
        for address in [a for a in self.workers if a not in wanted]:
            worker = self.workers.pop(address)
            worker.up = False
            self.metrics.worker_up.remove(self.role, address)
            self.metrics.forget_target(address)
            log.info("%s worker %s left the pool", self.role, address)
            with contextlib.suppress(Exception):
                await worker.backend.close()

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in list(self.workers.values())))

    async def check(self, worker: Worker) -> None:
        try:
            up = await asyncio.wait_for(worker.backend.health(), CALL_TIMEOUT_S)
            if up and not worker.up:  # (re)joined: it may be a new process
                worker.info = await asyncio.wait_for(worker.backend.info(), CALL_TIMEOUT_S)
                worker.compatible = self.compatible(worker)
        except Exception as error:  # noqa: BLE001 - any failure means not serving
            if worker.up:
                log.warning(
                    "%s worker %s failed its health check: %s", self.role, worker.address, error
                )
            up = False
        if up != worker.up:
            log.info("%s worker %s is %s", self.role, worker.address, "up" if up else "down")
        worker.up = up
        worker.ever_up |= up
        self.metrics.worker_up.labels(self.role, worker.address).set(1 if worker.serving else 0)
        if self.adaptive is not None and worker.cost.weight > 0:  # a measured target's
            self.metrics.observe_round_cost(worker.address, worker.cost.line(self.adaptive))
            self.metrics.observe_epochs(worker.address, worker.epochs, worker.load)

    def compatible(self, worker: Worker) -> bool:
        if worker.info is None or worker.info.pairs_with(self.fingerprint):
            return True
        log.error(
            "%s worker %s serves %s with tokenizer %s, the gateway's is %s: not used",
            self.role,
            worker.address,
            worker.info.model_id,
            worker.info.tokenizer_fingerprint,
            self.fingerprint,
        )
        return False

    def mark_down(self, worker: Worker, reason: str) -> None:
        if worker.up:
            log.warning("%s worker %s marked down: %s", self.role, worker.address, reason)
        worker.up = False
        if worker.address in self.workers:
            self.metrics.worker_up.labels(self.role, worker.address).set(0)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        for worker in self.workers.values():
            with contextlib.suppress(Exception):
                await worker.backend.close()


@dataclass
class Admission:
    """n live choices held by a request; released once, however the request ends."""

    router: Router
    n: int
    on_release: Callable[[Admission], None] | None = None  # told after the release
    since: float = field(default_factory=time.monotonic)
    released: bool = False

    async def arelease(self) -> None:
        """For a response's background task, which runs sync callables in a thread."""
        self.release()

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.router.live -= self.n
            self.router.metrics.live_sessions.set(self.router.live)
            if self.on_release is not None:
                self.on_release(self)


@dataclass
class Router:
    targets: Pool
    drafts: Pool | None  # None: decode with the target alone by configuration
    metrics: Metrics
    max_sessions: int = 64  # choices generated at once, over all workers
    affinity_entries: int = 10_000  # conversations remembered
    prefix_slack: int = 4  # most live sessions above the least loaded a prefix's worker may have
    prefix_entries: int = 100_000  # prompt blocks remembered for prefix-aware routing
    retry_after_s: int = 2
    ngram: Pool | None = None  # the in-gateway n-gram drafter, when the drafts are workers
    draining: bool = False  # set on SIGTERM: new requests get 503, live ones finish
    cut: bool = False  # set when the drain timed out: the live ones end with a 503 event
    live: int = 0
    affinity: OrderedDict[str, dict[Role, str]] = field(default_factory=OrderedDict)
    # (role, digest of a prompt prefix of whole blocks) -> the worker it last went to
    prefixes: OrderedDict[tuple[Role, bytes], str] = field(default_factory=OrderedDict)
    busy_ids: set[str] = field(default_factory=set)  # worker session ids in use
    pending: set[asyncio.Task] = field(default_factory=set)  # EndSession calls in flight

    def pool(self, role: Role) -> Pool | None:
        return self.targets if role == "target" else self.drafts

    def draft_pools(self) -> dict[str, Pool]:
        """The drafters a request may ask for by method: "ngram" (the n-gram drafter, in the
        gateway or as workers) and "draft" (draft model workers)."""
        pools: dict[str, Pool] = {}
        if self.drafts is not None:
            infos = [w.info for w in self.drafts.workers.values() if w.info is not None]
            ngram = bool(infos) and all(i.model_id == "ngram" for i in infos)
            pools["ngram" if ngram else "draft"] = self.drafts
        if self.ngram is not None:
            pools.setdefault("ngram", self.ngram)
        return pools

    def pools(self) -> list[Pool]:
        """Every pool: targets, drafts and the in-gateway n-gram drafter."""
        return [p for p in (self.targets, self.drafts, self.ngram) if p is not None]

    def owner(self, worker: Worker) -> Pool:
        """The pool the worker belongs to."""
        return next(p for p in self.pools() if p.workers.get(worker.address) is worker)

    def healthy(self) -> bool:
        """At least one target, and one draft unless drafting is off or in-gateway."""
        return bool(self.targets.serving()) and (self.drafts is None or bool(self.drafts.serving()))

    def context_length(self) -> int | None:
        lengths = [
            w.info.context_length
            for w in self.targets.serving()
            if w.info and w.info.context_length > 0
        ]
        return min(lengths) if lengths else None

    def eos_token_ids(self) -> set[int]:
        return {t for w in self.targets.serving() if w.info for t in w.info.eos_token_ids}

    def capacity(self) -> int:
        """Choices the serving targets hold at once, within max_sessions (0: no target)."""
        targets = self.targets.serving()
        return int(min(self.max_sessions, sum(w.capacity for w in targets))) if targets else 0

    def room(self, n: int) -> bool:
        """Whether n more live choices fit now; raises 503 (draining, no target) or 400
        (never fit)."""
        if self.draining:
            raise shutting_down(self.retry_after_s)
        capacity = self.capacity()
        if not capacity:
            raise APIError(
                503, "no healthy target worker", None, "no_healthy_target", self.retry_after_s
            )
        if n > capacity:
            raise APIError(
                400, f"the request needs {n} sessions; this server holds {capacity}", "n"
            )
        return self.live + n <= capacity

    def reserve(self, n: int, on_release: Callable[[Admission], None] | None = None) -> Admission:
        """Takes n live choices (gateway/admission.py decides when)."""
        self.live += n
        self.metrics.live_sessions.set(self.live)
        return Admission(self, n, on_release)

    def session_id(self, key: str | None, index: int) -> str:
        """A conversation reuses its worker session ids (and so their cached prefix)."""
        if key is not None:
            digest = hashlib.sha256(key.encode()).hexdigest()[:24]
            sid = f"conv-{digest}-{index}"
            if sid not in self.busy_ids:  # the same conversation may run twice at once
                self.busy_ids.add(sid)
                return sid
        return uuid.uuid4().hex

    def bind(
        self,
        role: Role,
        key: str | None,
        exclude: set[str],
        pool: Pool | None = None,
        width: int = 0,
        prefix: Sequence[bytes] = (),
    ) -> Worker | None:
        """The affine worker of `pool` (default: the role's) when it is serving, else the one
        that got the longest run of `prefix` (the session's prompt blocks' digests) within
        the slack, else the least loaded one. A feature draft is bound only to a session
        whose target's states are as wide as it feeds on (`width`; 0: any)."""
        pool = pool or self.pool(role)
        candidates = [
            w
            for w in (pool.serving() if pool else [])
            if w.address not in exclude
            and not (role == "draft" and width and w.feature_size not in (0, width))
        ]
        if not candidates:
            return None
        preferred = self.affinity.get(key, {}).get(role) if key is not None else None
        chosen = next((w for w in candidates if w.address == preferred), None)
        if chosen is None:
            least = min(candidates, key=lambda w: (w.load, w.picks))
            chosen = self.prefix_holder(role, prefix, candidates, least.load) or least
            if chosen is not least:
                self.metrics.prefix_routed.labels(role).inc()
        chosen.load += 1
        chosen.picks += 1
        if key is not None:
            self.affinity.setdefault(key, {})[role] = chosen.address
            self.affinity.move_to_end(key)
            while len(self.affinity) > self.affinity_entries:
                self.affinity.popitem(last=False)
        if len(pool.workers) > 1:  # one worker (the in-gateway n-gram drafter): nothing to pick
            for digest in prefix:
                self.prefixes[role, digest] = chosen.address
                self.prefixes.move_to_end((role, digest))
            while len(self.prefixes) > self.prefix_entries:
                self.prefixes.popitem(last=False)
        return chosen

    def prefix_holder(
        self, role: Role, prefix: Sequence[bytes], candidates: list[Worker], least: int
    ) -> Worker | None:
        """The candidate that got the longest run of `prefix`, more than half of it (SGLang's
        cache-aware router's threshold: a short match saves too little prefill to unbalance
        the workers for), with at most `prefix_slack` live sessions more than `least`; None:
        none."""
        by_address = {w.address: w for w in candidates}
        for depth in range(len(prefix), len(prefix) // 2, -1):
            worker = by_address.get(self.prefixes.get((role, prefix[depth - 1]), ""))
            if worker is not None and worker.load <= least + self.prefix_slack:
                return worker
        return None

    def unbind(self, worker: Worker, session_id: str, end: bool = True) -> None:
        worker.load -= 1
        if end:
            self.end(session_id, [worker])

    def fail(self, worker: Worker, error: Exception, session_id: str) -> None:
        """A call to the worker failed: mark it down (its sessions move elsewhere)."""
        self.owner(worker).mark_down(worker, f"{type(error).__name__}: {error}")
        self.metrics.failovers.labels(worker.role).inc()
        self.unbind(worker, session_id)

    def release(self, session_id: str) -> None:
        self.busy_ids.discard(session_id)

    def end(self, session_id: str, workers: list[Worker]) -> None:
        """Ends the session on every worker at once, in the background."""

        async def end_all() -> None:
            calls = [asyncio.wait_for(w.backend.end(session_id), CALL_TIMEOUT_S) for w in workers]
            for worker, result in zip(
                workers, await asyncio.gather(*calls, return_exceptions=True), strict=True
            ):
                if isinstance(result, Exception) and worker.up:
                    log.info("ending %s on %s failed: %s", session_id, worker.address, result)

        task = asyncio.get_running_loop().create_task(end_all())
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def drain(self) -> None:
        """Waits for the EndSession calls in flight (on shutdown)."""
        if self.pending:
            await asyncio.wait(list(self.pending), timeout=CALL_TIMEOUT_S)


def shutting_down(retry_after_s: int) -> APIError:
    """The 503 of a server that drains: new requests get it at once, and the requests
    still generating when the drain times out end with it."""
    return APIError(
        503,
        "this server is shutting down: retry (another replica takes the request)",
        None,
        "shutting_down",
        retry_after_s,
    )
