"""The model-free drafter: prompt lookup over each session's history.

With a suffix cache (workers/draft/suffix.py) it also copies from the recent
outputs of other requests of the same tenant (`ProposeCall.tenant`). It
answers the same `propose(calls) -> [TokenTree | Exception]` as
`ModelDrafter` and loads no model, so the gateway can run it in-process.
"""

from __future__ import annotations

from workers.draft.suffix import SuffixCache
from workers.engine.sessions import SessionTable
from workers.protocol import ProposeCall, TreeSpec, WorkerInfo
from workers.speculation.ngram import SuffixIndex, ngram_tree
from workers.speculation.tree import TokenTree, check_tokens

# The shortest suffix the drafter copies after by default. A one-token match is right
# less often (first token: 15% on chat, 28% on grounded rewrites; two-token matches
# 42-69%), yet on copy-heavy text its chains pay: in one sweep 2 made the default 10-13%
# slower at 1 and 4 grounded streams and gained nowhere beyond noise (bench/RESULTS.md,
# "The n-gram draft's shortest match").
MIN_MATCH = 1


def lookup_tree(
    history: SuffixIndex,
    spec: TreeSpec,
    suffixes: SuffixCache | None,
    tenant: str | None,
    min_ngram: int,
) -> TokenTree:
    """The n-gram drafter's tree within `spec` after `history` (the session's index of
    it): prompt lookup after a suffix of `min_ngram` tokens or more, plus the tenant's
    cached outputs when there is a suffix cache and a tenant (None: a request that neither
    reads nor feeds it). Also the n-gram part of a hybrid round (gateway/speculation.py)."""
    if spec.depth == 0 or spec.budget == 0:
        return TokenTree.empty()
    shared = []
    if suffixes is not None and tenant is not None:
        shared = suffixes.continuations(tenant, history.tokens, spec.depth)
    return ngram_tree(
        history,
        min_ngram=min_ngram,
        depth=spec.depth,
        budget=spec.budget,
        chain=spec.branching == 1,
        shared=shared,
    )


class NgramDrafter:
    """Prompt lookup over each session's history (and the tenant's cached outputs);
    needs no model and no KV. It drafts after a suffix of `min_match` tokens or more
    (vLLM's `prompt_lookup_min`)."""

    def __init__(
        self,
        table: SessionTable,
        vocab_size: int | None = None,
        suffixes: SuffixCache | None = None,
        min_match: int = MIN_MATCH,
    ):
        self.table = table
        self.vocab_size = vocab_size
        self.suffixes = suffixes  # None: the session's own history only
        self.min_match = min_match
        self.indexes: dict[str, SuffixIndex] = {}  # each held session's history, indexed

    def index(self, session_id: str, history: list[int], base_len: int) -> SuffixIndex:
        """The session's index, brought to its history after a call from `base_len`: built
        anew when the session (re)started, cut back to `base_len` (past it the call may
        have replaced a guess that ran ahead), extended with the rest. Indexes of sessions
        the table no longer holds go once there are more than its slots."""
        index = self.indexes.get(session_id)
        if index is None or base_len == 0:
            index = self.indexes[session_id] = SuffixIndex()
        index.truncate(base_len)
        index.extend(history[len(index) :])
        if len(self.indexes) > self.table.num_slots:
            for gone in [s for s in self.indexes if s not in self.table.sessions]:
                del self.indexes[gone]
        return index

    def propose(self, calls: list[ProposeCall]) -> list[TokenTree | Exception]:
        results: list[TokenTree | Exception] = []
        for call in calls:
            try:
                if self.vocab_size is not None:
                    check_tokens(call.tokens, self.vocab_size)
                synced = self.table.sync(call.session_id, call.base_len, call.tokens, rollback=True)
                history = self.index(call.session_id, synced.session.committed, call.base_len)
                results.append(
                    lookup_tree(history, call.spec, self.suffixes, call.tenant, self.min_match)
                )
            except Exception as error:  # noqa: BLE001 - returned to that caller only
                results.append(error)
        return results

    def end(self, session_id: str) -> bool:
        self.indexes.pop(session_id, None)
        return self.table.end(session_id)

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            "draft", "ngram", "", self.vocab_size or 0, 0, self.table.num_slots, len(self.table)
        )
