"""A feature draft: `ModelDrafter`'s level-by-level expansion over an EAGLE-style head.

The head (workers/engine/eagle.py) pairs each token it is fed with a hidden
state: a committed token t with the target's own state at t - 1, taken from
the call's `features` (the states the target returned with its latest
Verify); a tree node with the state the head itself predicted at its parent
one level earlier. Children are chosen as a model draft's are
(`ModelDrafter.grow`): a sampled tree carries the q rows its children were
drawn from, so verification stays lossless whatever the head predicts.

Its KV cache differs from a model draft's in what it keeps:
- the committed tokens a call brings are kept as soon as they are fed,
  since the next call brings only the states of newer tokens;
- last round's tree nodes are never kept, even on the accepted path: they
  were fed predicted states, and the next call brings the target's own
  states for those tokens.

A session this worker lost (restart, eviction, a failover to it) comes back
with its full history but only the latest round's states: older tokens are
fed with zero states (so is a token whose state a call does not bring for any
other reason). Their cache entries carry less, so acceptance is lower until
the session's recent tokens dominate; the output is still the target's.
"""

from __future__ import annotations

import torch

from workers.draft.runner import Expansion, ModelDrafter
from workers.engine.batch import SlotInput
from workers.engine.engine import Engine
from workers.engine.sessions import Session, SessionTable
from workers.protocol import ProposeCall


class FeatureDrafter(ModelDrafter):
    """Proposes trees with an EAGLE-style head; one head forward per level for all sessions."""

    @property
    def width(self) -> int:
        """E, the target's hidden size (the head's too)."""
        return self.engine.model.shape.hidden_size

    def sync(self, call: ProposeCall, busy: set[str]) -> Session:
        """`ModelDrafter.sync`, refusing states of another width than the head's."""
        if call.features is not None and call.features.states.shape[1] != self.width:
            raise ValueError(
                f"hidden states of width {call.features.states.shape[1]}: this head feeds on "
                f"{self.width}"
            )
        return super().sync(call, busy)

    def reuse(self, session: Session) -> None:
        """Drops last round's tree nodes: they were fed predicted states (module docstring)."""
        session.region_tokens, session.region_parents, session.region_fed = [], [], 0

    def forward(
        self, expansions: list[Expansion], chunks: list[tuple[ProposeCall, SlotInput]]
    ) -> list[torch.Tensor]:
        rows = [self.row(x) for x in expansions]
        fed = [self.inputs(x, len(r.tokens)) for x, r in zip(expansions, rows, strict=True)]
        for call, chunk in chunks:  # committed tokens at positions prefix_len, prefix_len + 1, ...
            fed.append(self.states(call, chunk.prefix_len, len(chunk.tokens)))
        states = torch.cat(fed)  # (N, E): the state paired with each fed token, rows in order
        out = self.engine.run(rows + [r for _, r in chunks], states, kept=True)
        for x, row, hidden in zip(expansions, rows, out.hidden, strict=False):
            # hidden: (T, E); the last logits_for rows are the states after the plan's nodes
            for node, state in zip(x.plan, hidden[-row.logits_for :], strict=True):
                x.features[node] = state
            if -1 in x.plan:  # level 0 fed the committed tokens: keep them now
                keep(self.engine, x.session)
        return out.logits

    def inputs(self, x: Expansion, n: int) -> torch.Tensor:
        """The states paired with the `n` tokens `row(x)` feeds: (n, E) float32."""
        if -1 in x.plan:  # level 0: the committed tokens not cached yet
            return self.states(x.call, x.session.cached, n)
        # level >= 1: each node to expand, with what the head predicted after its parent
        return torch.stack([x.features[x.parent_of[node]].float().cpu() for node in x.plan])

    def states(self, call: ProposeCall, first: int, n: int) -> torch.Tensor:
        """(n, E) float32: the target's state before each committed token at positions
        first .. first + n - 1 (the state of the position before it), zeros where the call
        brings none."""
        if call.features is None:
            return torch.zeros(n, self.width)
        return call.features.at(range(first - 1, first + n - 1), self.width)


def keep(engine: Engine, session: Session) -> None:
    """Commits the region fed at level 0 (the pending tokens) to the session's cache."""
    n = len(session.region_tokens)
    engine.commit(session.slot, session.cached, list(range(n)))
    session.cached += n
    session.region_tokens, session.region_parents, session.region_fed = [], [], 0


def model_drafter(
    engine: Engine, table: SessionTable, prefill_chunk: int | None = None
) -> ModelDrafter:
    """The drafter for a draft engine: a feature drafter over an EAGLE head, else a model."""
    kind = FeatureDrafter if engine.model.takes_features else ModelDrafter
    return kind(engine, table, prefill_chunk)
