"""Shadow drafts: what an n-gram draft would have accepted in rounds that drafted nothing.

A session whose estimates say drafting does not pay decodes without a draft,
and then learns nothing of its text: it had to draft a node now and then (a
probe, gateway.adaptive) to notice the text turn copyable, and a probe costs
the whole batch's forward. Prompt lookup needs only the history the gateway
owns, so a session with an n-gram draft looks its tree up anyway, keeps it
(`Shadow`), and scores it against the tokens the target then emits: a tree
walk along them gives the tokens a verify of that tree would have accepted.

That is exact in distribution, greedy or sampled. A deterministic draft token
t is accepted with probability p(t), the probability that the target samples
t (for greedy: iff t is the argmax, as the emitted token is); of siblings
t1, t2, ..., t2 is tried on the residual once t1 is rejected, with
probability p(t2) / (1 - p(t1)), so it is followed with probability p(t2),
again the chance the target emits it (workers.speculation.verify). So the
session's estimates follow its text at no target cost, and sessions with an
n-gram draft need no probes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.adaptive import RoundShape
from workers.engine.sessions import common_prefix
from workers.speculation.tree import TokenTree


@dataclass(frozen=True)
class Scored:
    """A decided shadow: its shape and the tokens a verify would have accepted."""

    shape: RoundShape
    accepted: int  # along the tree
    spine_accepted: int  # along its spine (the draft's best path)


@dataclass(frozen=True)
class Shadow:
    """The tree a session's n-gram draft would have proposed after history[:base]."""

    base: int
    kind: int  # the round's kind of rates (gateway.adaptive.RatesByMatch)
    tokens: tuple[int, ...]  # (N,) each node's token
    kids: tuple[tuple[int, ...], ...]  # entry 0 the root's children, entry i+1 node i's
    best: tuple[int, ...]  # the tree's spine
    shape: RoundShape

    @classmethod
    def of(cls, base: int, tree: TokenTree, kind: int = 0) -> Shadow | None:
        """None for an empty tree: a round that drafted would have drafted nothing. Plain
        lists, not the tree's tensor helpers: most rounds of a session that does not draft
        make one, and a tensor op costs microseconds."""
        if not len(tree):
            return None
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
        depth = []  # (N,) children of the root have depth 1
        for i, p in enumerate(parents):  # topological: a parent comes before its children
            kids[p + 1].append(i)
            depth.append(1 if p < 0 else depth[p] + 1)
        best, at = [], -1  # the spine: each node's first child from the root
        while kids[at + 1]:
            at = kids[at + 1][0]
            best.append(tokens[at])
        shape = RoundShape(max(depth), len(best), len(tokens))
        return cls(base, kind, tuple(tokens), tuple(map(tuple, kids)), tuple(best), shape)

    def score(self, history: Sequence[int]) -> Scored | None:
        """The round it stands for, once the tokens emitted after `base` decide it: they
        left the tree, or followed a path to its end. None until then."""
        emitted = history[self.base :]
        at = -1  # the node reached; -1: the root
        for depth, token in enumerate(emitted):
            below = self.kids[at + 1]
            at = next((i for i in below if self.tokens[i] == token), None)
            if at is None:
                return self.scored(depth, emitted)
        if self.kids[at + 1]:
            return None  # on a path that goes on: the next tokens decide
        return self.scored(len(emitted), emitted)

    def scored(self, accepted: int, emitted: Sequence[int]) -> Scored:
        return Scored(self.shape, accepted, common_prefix(list(self.best), list(emitted)))
