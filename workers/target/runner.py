"""The target side of speculation: verify token trees for many sessions at once.

One `verify` call takes the Verify requests of several sessions, feeds each
session's pending tokens (committed, not yet cached) followed by its draft
tree, all in one forward, and for each session keeps the accepted path in the
KV cache and advances its history by the accepted tokens plus the bonus token.
A request with an empty tree is a plain decode step (or a prefill when the
session starts from its full history).

With `prefill_chunk`, a call bringing more pending tokens than that is fed in
chunks of `prefill_chunk` tokens, one per step, and answered `UNFINISHED`
until its last chunk goes with its tree: the caller (the batcher) runs the
same call again in its next batch, so the other sessions' rounds go on between
the chunks instead of waiting for the whole prompt. The tokens are the same:
a chunk's keys and values are those the whole prompt would have written.

A call with `return_hidden` (a session whose draft is a feature draft) also
gets the final hidden states (before the final norm) of the positions it
committed: every token it fed but the bonus token, its earlier prefill chunks'
included, and those of the prefix it took from the prefix cache (the newest
`HIDDEN_BYTES` worth of them), as bfloat16 `Features`
(workers/protocol/calls.py). Other calls get none. Such a session takes cached
KV only as far as the states of it are kept (workers/target/states.py), and
its answers keep the states of the full blocks they complete for the next.

Decode steps: a call with an empty tree and `steps` > 1 (a session that drafts
nothing this round) is decoded on here for up to that many tokens, one forward
each, before it is answered: after each forward but the last it is answered
`UNFINISHED` like a prefill chunk, its token committed and fed by the next
step, so the target runs its next forward at once instead of waiting a round
trip for the session's next call (vLLM's multi-step scheduling). Each token
is the one a call of its own would have got: a sampled one is drawn with the
generator of its position. A step that emits a `stop_ids` token or fills the
context answers at once, and every such call is answered after the forwards
whose count is a multiple of its `steps`, so that sessions decoding side by
side go back to the gateway together and the target waits for their next
calls once every `steps` forwards, not once a forward.

Lookup during decode steps: an exact call with `lookup` > 0, greedy or sampled
without a seed, also has each of its decode steps verify up to that many tokens
the worker drafts itself, by prompt lookup over the session's history (the
continuations of its latest 3-token matches, workers/speculation/ngram.py), in
the same forward, where the forward's rows cost next to nothing, or where the
history agrees with its latest match over `LONG_MATCH` tokens, a copied run the
lookup's tokens continue almost always, while the forward feeds at most
`LONG_ROWS` tokens (`fill_rows`, after `fit_blocks`); the accepted ones and the
target's token after them are that step's tokens, up to `most` in all. What the
batch's sessions gain costs no round trip: a draft the gateway sends is a round
of its own, answered after one forward, and the steps beside it wait for its
next call (vLLM's n-gram speculation runs inside its engine for the same
reason). The output is the
target's whatever the lookup finds (the same `verify`: its greedy tokens, or
for a sampled call its distribution, a looked-up token being a deterministic
draft). A seeded sampled call looks nothing up: how many tokens a step drafts
depends on the batch beside it, and the seed alone must fix the text.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from workers.engine.batch import SlotInput
from workers.engine.engine import Engine
from workers.engine.kv_cache import OutOfBlocks
from workers.engine.sessions import Session, SessionTable
from workers.protocol import (
    FEATURE_DTYPE,
    UNFINISHED,
    Features,
    TokenLogprob,
    Unfinished,
    VerifyCall,
    VerifyOutcome,
    WorkerInfo,
)
from workers.speculation.ngram import MAX_NGRAM, SuffixIndex, ngram_tree
from workers.speculation.sampling import TARGET_STREAM, round_generator
from workers.speculation.tree import TokenTree, check_tokens, depths, validate_tree
from workers.speculation.verify import verify
from workers.target.states import STATE_BYTES, PrefixStates


@dataclass
class Prefill:
    """A call whose pending tokens are being fed in chunks, one per step."""

    call: VerifyCall
    prefix_hit: int
    # with return_hidden: the states of the cached prefix taken, then after each chunk fed
    # so far, (T_i, E) FEATURE_DTYPE each, the newest HIDDEN_BYTES worth
    states: list[torch.Tensor] = field(default_factory=list)


@dataclass
class Decoding:
    """A call being decoded for several tokens (`VerifyCall.steps`), between its steps."""

    call: VerifyCall
    prefix_hit: int
    emitted: list[int] = field(default_factory=list)  # its tokens so far
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one a token, when asked
    forwards: int = 0  # its steps so far
    lookup_nodes: int = 0  # tokens its steps' lookups drafted
    lookup_accepted: list[int] = field(default_factory=list)  # their indices in `emitted`


@dataclass(frozen=True)
class Prepared:
    call: VerifyCall
    session: Session
    row: SlotInput
    prefix_hit: int
    chunk: bool = False  # the row is a prefill chunk: no tree, no logits, more to come
    prefill: Prefill | None = None  # the chunks fed before this row, if any
    # with return_hidden, a (re)started session's states of the cached prefix it took,
    # (prefix, E) FEATURE_DTYPE (in `prefill.states` instead when it is fed in chunks)
    known: torch.Tensor | None = None
    dropped: int = 0  # nodes cut from the end of the call's tree (`TargetRunner.fit_blocks`)
    decoding: Decoding | None = None  # the call's earlier decode steps, if any
    looked_up: TokenTree | None = None  # a decode step's own draft (`TargetRunner.lookup`)

    @property
    def tree(self) -> TokenTree:
        """The tree this row verifies: the step's own draft, else the call's."""
        return self.looked_up if self.looked_up is not None else self.call.tree


def region(pending: list[int], tree: TokenTree) -> tuple[list[int], list[int]]:
    """Pending tokens as a chain, then the tree hung off the last of them."""
    p = len(pending)
    parents = list(range(-1, p - 1)) + [p - 1 if q < 0 else p + q for q in tree.parents.tolist()]
    return pending + tree.tokens.tolist(), parents


def takes_steps(call: VerifyCall) -> bool:
    """Whether the call is decoded on for several tokens (module docstring, "Decode
    steps"): steps asked, no tree of its own, no hidden states wanted."""
    return call.steps > 1 and not len(call.tree) and not call.return_hidden


def tree_row(session: Session, tree: TokenTree) -> SlotInput:
    """The session's row of a forward: its pending tokens and the tree, logits for the last
    pending token and every node."""
    tokens, parents = region(session.pending, tree)
    return SlotInput(session.slot, session.cached, parents, tokens, len(tree) + 1)


# Past the forward's cheap rows, a decode step still looks up where its history agrees
# with its latest match over this many tokens (`TargetRunner.lookup`): there the lookup's
# tokens were accepted 0.96 of the time, and a row beside 16-32 decode rows pays from about
# 0.8-0.9 (bench/RESULTS.md, "Long matches past the cheap rows")
LONG_MATCH = 6
# ... while the forward feeds at most this many tokens with them: beside 32 decode rows a
# row costs what an average one does, and such lookups measured break-even (grounded) and
# 0.96 of none (chat) there, +3-5% beside 16, +20-28% beside 8 (the same section)
LONG_ROWS = 32

# Most bytes of hidden states one Verify returns: of a longer prompt only its newest
# positions' states go; a feature draft feeds the older ones zeros. 16 MiB: 14,563
# positions of a 576-wide model, 2,048 of a 4,096-wide one.
HIDDEN_BYTES = 16 << 20


class TargetRunner:
    def __init__(
        self,
        engine: Engine,
        table: SessionTable,
        max_tree_nodes: int | None = None,
        prefill_chunk: int | None = None,
        hidden_bytes: int = HIDDEN_BYTES,
        state_bytes: int = STATE_BYTES,
        row_block: int | None = None,
        lookup_rows: int | None = None,
        long_match: int = LONG_MATCH,
    ):
        self.engine = engine
        self.row_block = row_block or engine.row_block  # see `fit_blocks`
        # a forward's tokens that decode steps' own drafts may fill (`fill_rows`)
        self.lookup_rows = engine.cheap_rows if lookup_rows is None else lookup_rows
        # past them, lookups of matches this long (0: none); none where rows come in blocks
        # (the tile unit): there a row past the forward's last block costs a pass over the
        # weights, which was not measured against what a long match brings
        self.long_match = long_match if self.row_block <= 1 else 0
        self.table = table
        table.attach(engine.cache)
        self.max_tree_nodes = min(max_tree_nodes or engine.max_tree_nodes, engine.max_tree_nodes)
        self.prefill_chunk = prefill_chunk  # most pending tokens fed per step; None = all
        self.hidden_bytes = hidden_bytes  # most bytes of hidden states one call returns
        self.chunking: dict[str, Prefill] = {}  # session -> its call being fed in chunks
        self.decoding: dict[str, Decoding] = {}  # session -> its call between decode steps
        # sessions whose last call ended their generation (`due_sessions`)
        self.finished: set[str] = set()
        self.forwards = 0  # forwards run; decode steps end on a multiple of a call's steps
        # session -> (that session, the index of its history) for decode steps' lookups
        self.indexes: dict[str, tuple[Session, SuffixIndex]] = {}
        # the states of shared prompt prefixes, for feature sessions (with prefix caching)
        shared = engine.cache.prefixes is not None
        self.states = (
            PrefixStates(engine.cache.block_size, state_bytes, engine.num_slots) if shared else None
        )

    def prepare(self, call: VerifyCall, busy: set[str]) -> Prepared:
        self.finished.discard(call.session_id)
        going = self.chunking.pop(call.session_id, None)
        decoding = self.decoding.pop(call.session_id, None)
        if going is not None and going.call is call:  # its next chunk: already synced
            session, hit = self.table.get(call.session_id), going.prefix_hit
            self.table.touch(session)
        elif decoding is not None and decoding.call is call:  # its next decode step
            going, session, hit = None, self.table.get(call.session_id), decoding.prefix_hit
            self.table.touch(session)
        else:
            going = decoding = None
            session, hit = self.sync(call, busy)
        known = None
        if going is None and call.return_hidden and call.base_len == 0 and session.cached:
            assert self.states is not None  # sync took no cached KV without its states
            known = self.states.rows(session.committed, call.cache_salt, session.cached)
        pending = session.pending
        if self.prefill_chunk and len(pending) > self.prefill_chunk:
            fed = pending[: self.prefill_chunk]
            row = SlotInput(session.slot, session.cached, list(range(-1, len(fed) - 1)), fed, 0)
            if going is None:
                going = Prefill(call, hit, [known] if known is not None else [])
                known = None
            self.chunking[call.session_id] = going
        else:
            row = tree_row(session, call.tree)
        self.table.reserve(session, session.cached + len(row.parents), busy)
        chunk = row.logits_for == 0
        return Prepared(call, session, row, hit, chunk, going, known, decoding=decoding)

    def fill_rows(self, prepared: list[tuple[int, Prepared]]) -> list[tuple[int, Prepared]]:
        """Decode steps' own drafts (module docstring, "Lookup during decode steps"): each
        step in turn gets up to its call's `lookup` tokens while the forward's tokens stay
        within the rows it computes about as cheaply as its first (`lookup_rows`), or
        within LONG_ROWS where its history agrees with its latest match over `long_match`
        tokens; and a session only where its KV blocks have room without evicting
        another."""
        free = self.lookup_rows - sum(len(p.row.tokens) for _, p in prepared)
        filled = []
        for i, p in prepared:
            tree = self.lookup(p, free)
            if tree is not None:
                row = tree_row(p.session, tree)
                try:
                    self.engine.cache.reserve(p.session.slot, p.session.cached + len(row.parents))
                except OutOfBlocks:
                    tree = None
            if tree is not None:
                free -= len(tree)
                p = replace(p, looked_up=tree, row=row)
            filled.append((i, p))
        return filled

    def lookup(self, p: Prepared, free: int) -> TokenTree | None:
        """A decode step's own draft: the continuations of the history's latest 3-token
        matches, at most `free` tokens (the cheap rows left), or the call's `lookup` where
        the latest match agrees over `long_match` tokens and the forward stays within
        LONG_ROWS tokens; no more than the call still emits less the step's own token;
        None where there is none."""
        call, session = p.call, p.session
        if p.chunk or not call.lookup or not takes_steps(call):
            return None
        if call.params.seeded or not call.acceptance.lossless:
            return None
        index = None  # the session's, brought up to date once a lookup needs it
        fed = self.lookup_rows - free  # the forward's tokens so far
        if free < call.lookup and self.long_match and fed + call.lookup <= LONG_ROWS:
            index = self.index(session)
            if index.agreement(self.long_match) >= self.long_match:
                free = call.lookup  # a long match takes its whole lookup
        emitted = len(p.decoding.emitted) if p.decoding is not None else 0
        room = min(
            call.lookup,
            free,
            call.most_emitted - emitted - 1,
            self.engine.context_length - len(session.committed) - 1,
        )
        if room <= 0:
            return None
        if index is None:
            index = self.index(session)
        tree = ngram_tree(index, min_ngram=MAX_NGRAM, depth=room, budget=room)
        return tree if len(tree) else None

    def index(self, session: Session) -> SuffixIndex:
        """The session's history indexed for lookups, brought up to date. A history that
        no longer extends the indexed one (a restart, a rollback) is indexed anew; a
        rollback that kept the last token is missed, which costs a draft's quality
        only, never the output."""
        held = self.indexes.get(session.id)
        committed = session.committed
        if (
            held is None
            or held[0] is not session
            or len(held[1]) > len(committed)
            or (len(held[1]) and held[1].tokens[-1] != committed[len(held[1]) - 1])
        ):
            if len(self.indexes) >= 2 * self.table.num_slots:  # drop those of evicted sessions
                self.indexes = {k: v for k, v in self.indexes.items() if k in self.table.sessions}
            held = self.indexes[session.id] = (session, SuffixIndex())
        index = held[1]
        index.extend(committed[len(index) :])
        return index

    def sync(self, call: VerifyCall, busy: set[str]) -> tuple[Session, int]:
        """Checks the call and brings its session up to date; returns it and the prefix hit."""
        check_tokens(call.tokens, self.engine.vocab_size)
        validate_tree(call.tree, self.engine.vocab_size, self.max_tree_nodes)
        depth = int(depths(call.tree.parents).max()) if len(call.tree) else 0
        if call.base_len + len(call.tokens) + depth > self.engine.context_length:
            raise ValueError(
                f"session {call.session_id!r} would exceed the context of "
                f"{self.engine.context_length} tokens"
            )
        # a feature draft needs every prompt position's state, and cached KV holds none: a
        # session that asks for states takes cached KV only as far as their states are kept
        reuse = None
        if call.return_hidden:
            reuse = 0
            if call.base_len == 0 and self.states is not None:  # a (re)start
                reuse = self.states.known(call.tokens, call.cache_salt)
                self.states.forget(call.session_id)  # its tail followed another history
        synced = self.table.sync(
            call.session_id, call.base_len, call.tokens, busy, salt=call.cache_salt, reuse=reuse
        )
        session = synced.session
        if session.cached == len(session.committed):  # the root must be fed for its logits
            self.table.rewind(session, session.cached - 1)
        return session, synced.prefix_hit

    def verify(self, calls: list[VerifyCall]) -> list[VerifyOutcome | Unfinished | Exception]:
        """Verifies every call in one forward; a bad call gets its own exception, a call
        whose prompt is still being prefilled in chunks `UNFINISHED`."""
        results: list[VerifyOutcome | Unfinished | Exception | None] = [None] * len(calls)
        prepared: list[tuple[int, Prepared]] = []
        busy = {c.session_id for c in calls}
        seen: set[str] = set()
        for i, call in enumerate(calls):
            try:
                if call.session_id in seen:
                    raise ValueError(f"session {call.session_id!r} appears twice in one batch")
                seen.add(call.session_id)
                prepared.append((i, self.prepare(call, busy)))
            except Exception as error:  # noqa: BLE001 - returned to that caller only
                results[i] = error
        prepared = self.fill_rows(self.fit_blocks(prepared))
        if prepared:
            out = self.engine.run([p.row for _, p in prepared])
            self.forwards += 1
            for (i, p), logits, hidden in zip(prepared, out.logits, out.hidden, strict=True):
                if p.chunk:
                    self.table.advance(p.session, len(p.row.tokens))
                    if p.call.return_hidden and p.prefill is not None:
                        self.keep_states(p.prefill, hidden)  # hidden: (chunk, E)
                    results[i] = UNFINISHED
                else:
                    results[i] = self.step_on(p, self.finish(p, logits, hidden))
        return results  # type: ignore[return-value]

    def step_on(self, p: Prepared, outcome: VerifyOutcome) -> VerifyOutcome | Unfinished:
        """A call decoding several tokens: its answer once done, else `UNFINISHED` with its
        step's token kept for the next (module docstring, "Decode steps")."""
        call = p.call
        if not takes_steps(call):
            return outcome
        done = p.decoding or Decoding(call, p.prefix_hit)
        if p.looked_up is not None:
            done.lookup_nodes += len(p.looked_up)
            first = len(done.emitted)
            done.lookup_accepted += range(first, first + len(outcome.accepted))
        done.emitted += outcome.emitted
        done.logprobs += outcome.logprobs or []
        done.forwards += 1
        ended = (
            (call.most and len(done.emitted) >= call.most)
            or any(token in call.stop_ids for token in outcome.emitted)
            or len(p.session.committed) >= self.engine.context_length
        )
        if not ended and len(done.emitted) < call.most_emitted and self.forwards % call.steps:
            self.decoding[call.session_id] = done
            return UNFINISHED
        if ended:
            if len(self.finished) >= 2 * self.table.num_slots:  # drop those of evicted sessions
                self.finished = {s for s in self.finished if s in self.table.sessions}
            self.finished.add(call.session_id)
        logprobs = done.logprobs if call.num_logprobs >= 0 else None
        return VerifyOutcome(
            [],
            done.emitted,
            logprobs,
            done.prefix_hit,
            steps=done.forwards,
            lookup_nodes=done.lookup_nodes,
            lookup_accepted=tuple(done.lookup_accepted),
        )

    def fit_blocks(self, prepared: list[tuple[int, Prepared]]) -> list[tuple[int, Prepared]]:
        """Cuts the last nodes of greedy trees where they alone would open the forward's
        last block of `row_block` rows and fill less than half of it.

        On the tile unit a forward computes its tokens 16 rows at a time, so a 17th
        token costs another pass over every layer's weights, what several more rows
        would (bench/RESULTS.md: a step of 16 decode rows takes 5-7 ms longer with one
        draft node beside them, out of 35-45 ms), and rows 18 to 32 ride along. A few
        nodes spilling past a multiple of 16 rarely accept enough to pay for that, so
        the target verifies the trees without them: the step then costs what a step of
        no drafts costs, and where trees fill the block they stay whole. Only trees of
        greedy exact calls are cut, whose output is the target's whatever their tree (a
        sampled call's text depends on its tree); of those the largest first, a tree's
        last node first (an n-gram tree numbers its nodes best first; any first nodes of
        a tree are a tree). An answer says how many nodes its call lost (`dropped`).
        """
        block = self.row_block
        if block <= 1:
            return prepared
        total = sum(len(p.row.tokens) for _, p in prepared)
        spill = total - (total - 1) // block * block  # tokens in the last block, 1 .. block
        sizes = {
            j: len(p.call.tree)
            for j, (_, p) in enumerate(prepared)
            if not p.chunk and p.call.params.greedy and p.call.acceptance.lossless
        }
        if 2 * spill >= block or sum(sizes.values()) < spill:
            return prepared
        dropped = dict.fromkeys(sizes, 0)
        for _ in range(spill):
            largest = max(sizes, key=lambda j: (sizes[j] - dropped[j], j))
            dropped[largest] += 1
        return [
            (i, self.cut(p, dropped[j]) if dropped.get(j) else p)
            for j, (i, p) in enumerate(prepared)
        ]

    @staticmethod
    def cut(p: Prepared, dropped: int) -> Prepared:
        """The prepared call without the last `dropped` nodes of its tree."""
        tree = p.call.tree.head(len(p.call.tree) - dropped)
        return replace(
            p, call=replace(p.call, tree=tree), row=tree_row(p.session, tree), dropped=dropped
        )

    def finish(self, p: Prepared, logits: torch.Tensor, hidden: torch.Tensor) -> VerifyOutcome:
        # logits: (N + 1, V): row 0 after the last pending token, row i + 1 after node i
        # hidden: (P + N, E): the state after each pending token, then after each node
        session, call = p.session, p.call
        start = session.cached  # the history position of the first token fed
        tree = p.tree
        generator = round_generator(call.params, len(session.committed), TARGET_STREAM)
        verdict = verify(tree, logits, call.params, generator, call.acceptance)
        pending = len(session.pending)
        keep = list(range(pending)) + [pending + a for a in verdict.accepted]
        self.engine.commit(session.slot, session.cached, keep)
        emitted = [int(tree.tokens[a]) for a in verdict.accepted] + [verdict.bonus]
        session.committed.extend(emitted)
        self.table.advance(session, len(keep))
        rows = [0] + [1 + a for a in verdict.accepted]
        logprobs = None
        if call.num_logprobs >= 0:
            logprobs = token_logprobs(logits[rows], emitted, call.num_logprobs)
        features = None
        if call.return_hidden:  # the states of the positions kept: all but the bonus token's
            most = self.hidden_rows(hidden.shape[1])
            earlier = p.prefill.states if p.prefill is not None else []
            known = [p.known] if p.known is not None else []
            newest = hidden[keep[-most:]].to(FEATURE_DTYPE).cpu()  # only what can be sent
            states = torch.cat([*earlier, *known, newest])[-most:]  # (R, E)
            features = Features(start + len(keep) - len(states), states)
            if self.states is not None:
                history = session.committed[: features.start + len(states)]
                self.states.keep(session.id, history, call.cache_salt, features.start, states)
        return VerifyOutcome(
            verdict.accepted, emitted, logprobs, p.prefix_hit, hidden=features, dropped=p.dropped
        )

    def hidden_rows(self, width: int) -> int:
        """Most states one call returns, of `width` bfloat16 values each."""
        return max(1, self.hidden_bytes // (2 * width))

    def keep_states(self, prefill: Prefill, hidden: torch.Tensor) -> None:
        """Keeps a chunk's states (T, E) for the call's answer, the newest HIDDEN_BYTES."""
        prefill.states.append(hidden.to(FEATURE_DTYPE).cpu())
        most = self.hidden_rows(hidden.shape[1])
        while sum(len(s) for s in prefill.states[1:]) >= most:
            prefill.states.pop(0)

    def due_sessions(self) -> list[str]:
        """The sessions held that may call again soon: not those whose last call ended
        their generation (a stop token, the context, or its `most` tokens: the gateway's
        `most` is what the request still wants). The batcher waits for the sessions of
        its previous step among these only (workers/rpc/batcher.py): a call of decode
        steps that ends its request before its batch's steps would otherwise keep every
        session still stepping waiting up to a step for a call that never comes."""
        return [s for s in self.table.sessions if s not in self.finished]

    def end(self, session_id: str) -> bool:
        self.finished.discard(session_id)
        self.chunking.pop(session_id, None)
        self.decoding.pop(session_id, None)
        self.indexes.pop(session_id, None)
        if self.states is not None:
            self.states.forget(session_id)
        return self.table.end(session_id)

    def info(self) -> WorkerInfo:
        info = self.engine.info("target", self.max_tree_nodes, len(self.table))
        return replace(info, lookup_rows=self.lookup_rows)


def token_logprobs(logits: torch.Tensor, tokens: list[int], top_n: int) -> list[TokenLogprob]:
    # logits: (K, V) at the parent of each emitted token; tokens: K ids
    logp = torch.log_softmax(logits.float(), dim=-1)  # (K, V)
    top = logp.topk(top_n, dim=-1) if top_n > 0 else None
    out = []
    for k, token in enumerate(tokens):
        alternatives = []
        if top is not None:
            alternatives = list(zip(top.indices[k].tolist(), top.values[k].tolist(), strict=True))
        out.append(TokenLogprob(token, float(logp[k, token]), alternatives))
    return out
