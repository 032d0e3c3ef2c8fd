"""The draft side of speculation: propose token trees for many sessions at once.

`ModelDrafter` expands a tree with a small model, level by level, one
forward per level for all sessions in the batch. The nodes it fed stay in
its KV cache; next round, the part of them that the target accepted is kept
(compacted) and the rest is overwritten. It shares its interface,
`propose(calls) -> [TokenTree | Exception]`, with the model-free
`NgramDrafter` (workers/draft/ngram.py). The feature drafter
(`FeatureDrafter`, workers/draft/features.py) is this expansion over an
EAGLE-style head; it overrides the hooks `reuse` (what of last round's
region to keep) and `forward` (one level).

With `prefill_chunk`, a session whose uncached history is longer than that
(a long prompt arriving) is fed a chunk of it per step, beside the other
sessions' first level, and answered `UNFINISHED` until the rest fits in one
chunk: the batcher runs the same call again in its next batch, so the other
sessions' proposals go on between the chunks (as the target's verify does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.engine.batch import SlotInput
from workers.engine.engine import Engine
from workers.engine.sessions import Session, SessionTable
from workers.protocol import UNFINISHED, ProposeCall, Unfinished, WorkerInfo
from workers.speculation.policy import TreeBuilder, TreePolicy, choose_children, tree_policy
from workers.speculation.sampling import DRAFT_STREAM, round_generator, tempered
from workers.speculation.tree import TokenTree, check_tokens


@dataclass
class Expansion:
    """One session's tree while it is being drafted."""

    call: ProposeCall
    session: Session
    policy: TreePolicy
    generator: torch.Generator | None
    builder: TreeBuilder = field(default_factory=TreeBuilder)
    region_of: dict[int, int] = field(default_factory=dict)  # builder node -> region offset
    parent_of: dict[int, int] = field(default_factory=dict)  # builder node -> its parent
    plan: dict[int, int] = field(default_factory=dict)  # node to expand -> children
    # feature drafts: builder node -> the state the head predicted after it (-1 = the root)
    features: dict[int, torch.Tensor] = field(default_factory=dict)


def absorb(engine: Engine, table: SessionTable, session: Session) -> None:
    """Keeps the cached part of last round's region that lies on the committed path."""
    keep: list[int] = []
    node = -1
    fed_children: dict[int, list[int]] = {}
    for i in range(session.region_fed):
        fed_children.setdefault(session.region_parents[i], []).append(i)
    for token in session.pending:
        match = [c for c in fed_children.get(node, []) if session.region_tokens[c] == token]
        if not match:
            break
        node = match[0]
        keep.append(node)
    if keep:
        engine.commit(session.slot, session.cached, keep)
        table.advance(session, len(keep))
    session.region_tokens, session.region_parents, session.region_fed = [], [], 0


class ModelDrafter:
    def __init__(self, engine: Engine, table: SessionTable, prefill_chunk: int | None = None):
        self.engine = engine
        self.table = table
        table.attach(engine.cache)
        self.prefill_chunk = prefill_chunk  # most history tokens fed per step; None = all
        self.chunking: dict[str, ProposeCall] = {}  # session -> its call being prefilled
        # (K,) the target id each logits column stands for (forwards read out the LM head's
        # kept rows alone); None = column i is id i
        self.ids = None if engine.model.kept is None else engine.model.kept.cpu()

    def sync(self, call: ProposeCall, busy: set[str]) -> Session:
        """Checks the call and brings its session up to date, unless this is its next chunk."""
        if self.chunking.pop(call.session_id, None) is call:
            session = self.table.get(call.session_id)
            self.table.touch(session)
            return session
        check_tokens(call.tokens, self.engine.vocab_size)
        synced = self.table.sync(
            call.session_id, call.base_len, call.tokens, busy, rollback=True, salt=call.cache_salt
        )
        self.reuse(synced.session)
        return synced.session

    def chunk(self, call: ProposeCall, session: Session, busy: set[str]) -> SlotInput | None:
        """The next prefill chunk of a session with more uncached history than one chunk."""
        if not self.prefill_chunk or len(session.pending) <= self.prefill_chunk:
            return None
        fed = session.pending[: self.prefill_chunk]
        self.table.reserve(session, session.cached + len(fed), busy)
        self.chunking[call.session_id] = call
        return SlotInput(session.slot, session.cached, list(range(-1, len(fed) - 1)), fed, 0)

    def start(self, call: ProposeCall, session: Session, busy: set[str]) -> Expansion | None:
        """The session's expansion, or None when no tree is wanted."""
        if session.cached == len(session.committed):  # the root must be fed for its logits
            self.table.rewind(session, session.cached - 1)
        spec = call.spec
        depth = min(spec.depth, self.engine.context_length - len(session.committed) - 1)
        if depth <= 0 or spec.budget == 0:
            return None
        # the region grows by the pending tokens, then at most `branching` nodes a level
        room = len(session.committed) + depth * spec.branching
        self.table.reserve(session, min(room, self.engine.cache.max_seq_len), busy)
        policy = tree_policy(depth, spec.branching, spec.budget)
        generator = round_generator(spec.params, len(session.committed), DRAFT_STREAM)
        session.region_tokens = list(session.pending)
        session.region_parents = list(range(-1, len(session.pending) - 1))
        expansion = Expansion(call, session, policy, generator)
        expansion.plan = policy.expand_plan(expansion.builder, 0)
        return expansion

    def propose(self, calls: list[ProposeCall]) -> list[TokenTree | Unfinished | Exception]:
        """Drafts every call's tree, one forward per level for all of them; a bad call gets
        its own exception, a call whose history is still being prefilled `UNFINISHED`."""
        results: list[TokenTree | Unfinished | Exception | None] = [None] * len(calls)
        busy = {c.session_id for c in calls}
        active: list[tuple[int, Expansion]] = []
        chunks: list[tuple[int, Session, SlotInput]] = []  # fed beside the first level
        for i, call in enumerate(calls):
            try:
                session = self.sync(call, busy)
                row = self.chunk(call, session, busy)
                if row is not None:
                    chunks.append((i, session, row))
                    continue
                expansion = self.start(call, session, busy)
                if expansion is None:
                    results[i] = TokenTree.empty()
                else:
                    active.append((i, expansion))
            except Exception as error:  # noqa: BLE001 - returned to that caller only
                results[i] = error
        level = 0
        while active or chunks:
            logits = self.forward([x for _, x in active], [(calls[i], r) for i, _, r in chunks])
            for i, session, row in chunks:
                self.table.advance(session, len(row.tokens))
                results[i] = UNFINISHED
            chunks = []
            still = []
            for (i, x), out in zip(active, logits[: len(active)], strict=True):
                x.session.region_fed = len(x.session.region_tokens)
                self.grow(x, out)
                x.plan = (
                    {}
                    if level + 1 >= x.policy.depth
                    else x.policy.expand_plan(x.builder, level + 1)
                )
                if x.plan and any(x.plan.values()):
                    still.append((i, x))
                else:
                    results[i] = x.policy.build(x.builder) if len(x.builder) else TokenTree.empty()
            active, level = still, level + 1
        return results  # type: ignore[return-value]

    def reuse(self, session: Session) -> None:
        """Keeps what last round's region has on the committed path."""
        absorb(self.engine, self.table, session)

    def forward(
        self, expansions: list[Expansion], chunks: list[tuple[ProposeCall, SlotInput]]
    ) -> list[torch.Tensor]:
        """One level for every expansion, with the prefill chunks fed beside it: logits
        (len(plan), K) per expansion in plan order (over `ids`), then (0, K) per chunk."""
        rows = [self.row(x) for x in expansions] + [r for _, r in chunks]
        return self.engine.run(rows, kept=True).logits

    def row(self, x: Expansion) -> SlotInput:
        """Feeds the nodes to expand (the pending tokens at level 0)."""
        session = x.session
        if -1 not in x.plan:  # level >= 1: append the nodes to expand to the region
            for node in x.plan:
                parent = x.parent_of[node]
                x.region_of[node] = len(session.region_tokens)
                session.region_tokens.append(x.builder.token(node))
                session.region_parents.append(
                    len(session.pending) - 1 if parent < 0 else x.region_of[parent]
                )
        fed = session.region_tokens[session.region_fed :]
        return SlotInput(
            session.slot,
            session.cached,
            list(session.region_parents),
            fed,
            logits_for=len(x.plan) if -1 not in x.plan else 1,
        )

    def grow(self, x: Expansion, logits: torch.Tensor) -> None:
        # logits: (len(plan), K), one row per node to expand, in plan order, over `ids`
        params = x.call.spec.params
        for (node, k), row in zip(x.plan.items(), logits, strict=True):
            if k == 0:
                continue
            temperature = params.temperature if not params.greedy else 1.0
            probs = torch.softmax(tempered(row.float(), temperature), dim=-1)  # (K,)
            tokens, q_tokens, q_probs, logps = choose_children(probs, k, params, x.generator)
            if self.ids is not None:  # columns -> target ids; off the kept ids q is 0
                tokens = self.ids[tokens]
                q_tokens = None if q_tokens is None else self.ids[q_tokens]
            for j in range(len(tokens)):
                child = x.builder.add(
                    node,
                    int(tokens[j]),
                    float(logps[j]),
                    None if q_tokens is None else q_tokens[j],
                    None if q_probs is None else q_probs[j],
                )
                x.parent_of[child] = node

    def end(self, session_id: str) -> bool:
        self.chunking.pop(session_id, None)
        return self.table.end(session_id)

    def info(self) -> WorkerInfo:
        return self.engine.info("draft", 0, len(self.table))
