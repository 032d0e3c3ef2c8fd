"""Tree-building policies: which draft nodes to expand, how many children, what to keep.

The draft engine runs the model; a policy only decides. One loop drives every
policy::

    builder = TreeBuilder()
    for level in range(policy.depth):
        plan = policy.expand_plan(builder, level)      # {parent node: n children}
        if not plan:
            break
        probs = draft_forward(builder, plan)           # (len(plan), V) draft probs
        for (parent, k), row in zip(plan.items(), probs):
            toks, q_toks, q_probs, logps = choose_children(row, k, params, gen)
            for j in range(len(toks)):
                builder.add(parent, int(toks[j]), float(logps[j]),
                            None if q_toks is None else q_toks[j],
                            None if q_probs is None else q_probs[j])
    tree = policy.build(builder)

Level ``L`` expands nodes at depth ``L`` (the root is depth 0) into depth
``L + 1``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from workers.speculation.sampling import SamplingParams, cpu_array, uniform
from workers.speculation.tree import TokenTree

# Sampled children are drawn from the draft's top-K tokens, K = max(k, DRAFT_TOP_K):
# the tail beyond that rarely gets accepted, and the q rows stay small.
DRAFT_TOP_K = 8


def choose_children(
    probs: torch.Tensor,
    k: int,
    params: SamplingParams | bool,
    generator: torch.Generator | None = None,
    top_k: int = DRAFT_TOP_K,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Pick up to k children of one node from the draft's next-token probs (V,).

    ``params`` is the request's SamplingParams or a bool meaning "greedy".
    ``probs`` should already be shaped as the draft samples (usually
    ``target_probs(draft_logits, params)``).

    Greedy: the k most likely tokens, deterministic; q rows are None (one-hot).
    Sampling: k draws *without replacement* from the draft restricted to its
    K = max(k, top_k) most likely tokens and renormalised. Row i of the
    returned q is the distribution child i was drawn from: that truncated
    draft with children 0..i-1 removed and renormalised, exactly what
    verification needs.

    Returns (tokens (k',), q_tokens (k', K) or None, q_probs (k', K) or None,
    logps (k',)) where logps is each token's log-probability under the full
    ``probs`` (for reranking). k' < k when fewer than k tokens have
    probability > 0; zero-probability tokens are never returned.
    """
    if not isinstance(probs, torch.Tensor) or probs.dim() != 1 or not probs.is_floating_point():
        raise ValueError("probs must be a 1-D float tensor (V,)")
    if k < 1 or top_k < 1:
        raise ValueError(f"k and top_k must be >= 1, got k={k} top_k={top_k}")
    array = cpu_array(probs)  # NaN fails too: numpy's min and max propagate it
    if array is not None:
        valid = bool(array.min() >= 0 and array.max() < math.inf)
    else:
        valid = bool(((probs >= 0) & (probs < float("inf"))).all())
    if not valid:
        raise ValueError("probs must be finite and non-negative")
    greedy = params if isinstance(params, bool) else params.greedy
    if not greedy and generator is None:
        raise ValueError("sampled children need a generator")
    v = probs.shape[0]
    width = min(k, v) if greedy else min(v, max(k, top_k))
    vals, support = probs.detach().topk(width)  # (K,), (K,) on the draft's device
    vals, support = vals.float().cpu(), support.cpu()  # only K values leave the device

    if greedy:
        keep = vals > 0  # (k,)
        return support[keep], None, None, vals[keep].log()

    # k draws without replacement, one at a time: child i is drawn from the truncated
    # draft with children 0..i-1 removed and renormalised, which is its q row
    weights = vals.tolist()  # K floats: mass not drawn yet
    picks: list[int] = []
    rows: list[list[float]] = []
    while len(picks) < k and sum(weights) > 0:
        total = sum(weights)
        row = [w / total for w in weights]
        j = _draw(row, uniform(generator))
        picks.append(j)
        rows.append(row)
        weights[j] = 0.0
    picked = torch.tensor(picks, dtype=torch.long)  # (k',)
    q_tokens = support.expand(len(picks), -1).clone()  # (k', K)
    q_probs = torch.tensor(rows, dtype=torch.float32).reshape(len(picks), len(weights))  # (k', K)
    return support[picked], q_tokens, q_probs, vals[picked].log()


def _draw(row: list[float], u: float) -> int:
    """Inverse CDF over a short list: the first non-empty slot whose cumulative mass exceeds u."""
    last = max(i for i, w in enumerate(row) if w > 0)  # guards u * total rounding up
    acc = 0.0
    for i, w in enumerate(row):
        acc += w
        if w > 0 and u < acc:
            return i
    return last


class TreeBuilder:
    """Accumulates draft nodes during one round; ``build`` turns them into a TokenTree.

    Each node keeps its token, parent, depth, step and cumulative draft
    log-prob (the latter summed along its path) and, for sampled drafts, its
    q row.
    """

    def __init__(self) -> None:
        self._tokens: list[int] = []
        self._parents: list[int] = []
        self._depths: list[int] = []
        self._logp: list[float] = []
        self._cum_logp: list[float] = []
        self._q: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self._kids: list[list[int]] = [[]]  # entry 0: the root's children, i+1: node i's

    def __len__(self) -> int:
        return len(self._tokens)

    def add(
        self,
        parent: int,
        token: int,
        logp: float,
        q_tokens: torch.Tensor | None = None,
        q_probs: torch.Tensor | None = None,
    ) -> int:
        """Append a child of ``parent`` (-1 for the root); returns the new node's index.

        ``logp`` is the token's draft log-prob given its path (one step, not
        cumulative). Children of one parent must be added in the order they
        were drawn. Either every node has a q row (K,) or none does.
        """
        n = len(self._tokens)
        if not -1 <= parent < n:
            raise ValueError(f"parent {parent} is not the root (-1) or an existing node (< {n})")
        if token < 0:
            raise ValueError(f"token must be >= 0, got {token}")
        if math.isnan(logp) or logp > 0:
            raise ValueError(f"logp must be a log-probability (<= 0), got {logp}")
        if (q_tokens is None) != (q_probs is None):
            raise ValueError("q_tokens and q_probs must be given together")
        if n and (q_tokens is None) != (self._q[0] is None):
            raise ValueError("either every node carries a q row or none does")
        if q_tokens is not None and q_probs is not None:
            if q_tokens.dim() != 1 or q_tokens.shape != q_probs.shape:
                raise ValueError(
                    f"q row must be two (K,) tensors, got {tuple(q_tokens.shape)} "
                    f"and {tuple(q_probs.shape)}"
                )
            row = (q_tokens.detach().to("cpu", torch.long), q_probs.detach().to("cpu", torch.float))
            self._q.append(row)
        else:
            self._q.append(None)
        self._tokens.append(int(token))
        self._parents.append(parent)
        self._depths.append(1 if parent < 0 else self._depths[parent] + 1)
        self._logp.append(logp)
        self._cum_logp.append(logp + (0.0 if parent < 0 else self._cum_logp[parent]))
        self._kids[parent + 1].append(n)
        self._kids.append([])
        return n

    def token(self, i: int) -> int:
        """Token of node i."""
        return self._tokens[i]

    def depth(self, i: int) -> int:
        """Depth of node i (children of the root: 1)."""
        return self._depths[i]

    def cum_logp(self, i: int) -> float:
        """Cumulative draft log-prob of the path ending at node i."""
        return self._cum_logp[i]

    def children_of(self, i: int) -> list[int]:
        """Children of node i (-1: of the root), in the order they were added."""
        return list(self._kids[i + 1])

    def rank_path(self, i: int) -> tuple[int, ...]:
        """Sibling ranks from the root down to node i, e.g. (0, 1) = root's eldest, its second."""
        ranks: list[int] = []
        while i >= 0:
            p = self._parents[i]
            ranks.append(self._kids[p + 1].index(i))
            i = p
        return tuple(reversed(ranks))

    def level(self, depth: int) -> list[int]:
        """Nodes at ``depth`` (0: none, the root is implicit), in index order."""
        return [i for i, d in enumerate(self._depths) if d == depth]

    def best(self, nodes: Sequence[int], n: int) -> list[int]:
        """The n of ``nodes`` with the highest cumulative log-prob (earlier index on ties)."""
        return sorted(nodes, key=lambda i: (-self._cum_logp[i], i))[:n]

    @property
    def sampled(self) -> bool:
        """True when the nodes carry q rows (children were sampled, not taken top-k)."""
        return bool(self._q) and self._q[0] is not None

    def score(self, i: int) -> float:
        """How much ``build`` wants to keep node i (higher first).

        Deterministic drafts: the cumulative draft log-prob (EAGLE-2). Sampled
        drafts: the draft's estimate of the log-probability that verification
        *tries* node i, i.e. reaches its parent and rejects every elder sibling:
        cum_logp(parent) + log(1 - draft mass of the elder siblings). It leaves
        node i's own token out on purpose (see ``_select``).
        """
        parent = self._parents[i]
        if not self.sampled:
            return self._cum_logp[i]
        siblings = self._kids[parent + 1]
        elder_mass = sum(math.exp(self._logp[e]) for e in siblings[: siblings.index(i)])
        base = 0.0 if parent < 0 else self._cum_logp[parent]
        return base + math.log(1 - elder_mass) if elder_mass < 1 else -math.inf

    def _select(self, budget: int) -> list[int]:
        """The ``budget`` best nodes by ``score``, as a closed set, in index order.

        EAGLE-2 reranking keeps the top nodes by score. A kept node also needs
        its ancestors (to be reachable) and its elder siblings (under sampling
        its q row is conditional on them having been drawn). So each node is
        ranked by its *effective* score: the best score among itself, its
        descendants and its younger siblings (and theirs), i.e. among every
        node that needs it. Effective scores never increase from a node to a
        child or a younger sibling, so the top ``budget`` (earlier index on
        ties) always form a closed set, and each node comes in as soon as the
        most valuable node depending on it does.

        Under sampling the score must not depend on the node's own token:
        verification treats node i's token as a draw from its q row, but if
        the decision to keep i looked at that token (as EAGLE-2's cumulative
        log-prob does), the kept token is a draw from q *conditioned on being
        kept*, and the output is biased (tests/speculation/test_lossless.py measures
        this). The "verification tries it" score depends only on ancestors and
        elder siblings and is already non-increasing (a child's first slot is
        cum_logp(node) <= the node's own score, since the node and its elders
        are distinct tokens), so the effective score is the score itself and
        whether a node is kept is settled by nodes ranked before it, never by
        its own token. Deterministic drafts have no such constraint
        (verification is exact for any candidate set), so they keep EAGLE-2's
        score.
        """
        n = len(self)
        effective = [self.score(i) for i in range(n)]
        for i in reversed(range(n)):  # dependents have larger indices: done first
            siblings = self._kids[self._parents[i] + 1]
            rank = siblings.index(i)
            if rank + 1 < len(siblings):  # next younger sibling (carries all younger ones)
                effective[i] = max(effective[i], effective[siblings[rank + 1]])
            if self._kids[i + 1]:  # eldest child (carries the whole subtree)
                effective[i] = max(effective[i], effective[self._kids[i + 1][0]])
        order = sorted(range(n), key=lambda i: (-effective[i], i))
        return sorted(order[:budget])

    def build(self, budget: int | None = None) -> TokenTree:
        """The tree of all nodes, or of at most ``budget`` of them (see ``_select``).

        Kept nodes are renumbered in their original (topological, elder-first)
        order and keep their q rows, padded to a common K with prob-0 entries.
        """
        if budget is not None and budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        n = len(self)
        kept = list(range(n)) if budget is None or n <= budget else self._select(budget)
        new_index = {old: new for new, old in enumerate(kept)}
        tokens = torch.tensor([self._tokens[i] for i in kept], dtype=torch.long)  # (N,)
        parents = torch.tensor(  # (N,)
            [new_index[self._parents[i]] if self._parents[i] >= 0 else -1 for i in kept],
            dtype=torch.long,
        )
        if not kept or self._q[0] is None:
            return TokenTree(tokens=tokens, parents=parents)
        rows = [r for r in (self._q[i] for i in kept) if r is not None]
        width = max(toks.shape[0] for toks, _ in rows)
        # ragged rows (k > DRAFT_TOP_K somewhere) are padded with token 0, prob 0
        q_tokens = torch.stack([F.pad(t, (0, width - t.shape[0])) for t, _ in rows])  # (N, K)
        q_probs = torch.stack([F.pad(q, (0, width - q.shape[0])) for _, q in rows])  # (N, K)
        return TokenTree(tokens=tokens, parents=parents, q_tokens=q_tokens, q_probs=q_probs)


class TreePolicy(ABC):
    """Decides the tree's shape; the engine loop in this module's docstring drives it."""

    depth: int  # most levels to expand
    max_nodes: int  # most nodes ``build`` returns

    @abstractmethod
    def expand_plan(self, builder: TreeBuilder, level: int) -> dict[int, int]:
        """Nodes at depth ``level`` to expand (-1 = root) -> how many children to draw."""

    @abstractmethod
    def build(self, builder: TreeBuilder) -> TokenTree:
        """The tree to verify, from everything drafted this round."""


# A 16-node tree, Medusa-style: wide near the root where the draft is surest,
# one long spine down the most likely path.
DEFAULT_TREE: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
    (0, 0, 0, 0),
    (0, 0, 0, 0, 0),
)  # fmt: skip


class StaticTreePolicy(TreePolicy):
    """A fixed tree shape given as rank paths (Medusa, Cai et al. 2024).

    Each path is a tuple of sibling ranks from the root: (0,) is the root's
    most likely child, (0, 1) that child's second. The set must be closed:
    every path's parent path and elder sibling path are in it too (the tree
    a static shape yields is then closed under ancestors and elder siblings,
    as verification under sampling requires).
    """

    def __init__(self, paths: Sequence[tuple[int, ...]]) -> None:
        shape = [tuple(int(r) for r in p) for p in paths]
        if not shape:
            raise ValueError("a static tree needs at least one path")
        seen = set(shape)
        if len(seen) != len(shape):
            raise ValueError("static tree paths contain duplicates")
        fanout: dict[tuple[int, ...], int] = {}
        for p in shape:
            if not p or min(p) < 0:
                raise ValueError(f"path {p} must be a non-empty tuple of ranks >= 0")
            if len(p) > 1 and p[:-1] not in seen:
                raise ValueError(f"path {p} has no parent path {p[:-1]}")
            if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in seen:
                raise ValueError(f"path {p} has no elder sibling {p[:-1] + (p[-1] - 1,)}")
            fanout[p[:-1]] = max(fanout.get(p[:-1], 0), p[-1] + 1)
        self.paths: tuple[tuple[int, ...], ...] = tuple(shape)
        self._fanout = fanout  # parent rank path -> number of children
        self.depth = max(len(p) for p in shape)
        self.max_nodes = len(shape)

    @classmethod
    def chain(cls, depth: int) -> StaticTreePolicy:
        """A single path of ``depth`` nodes (classic speculative decoding)."""
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        return cls([(0,) * d for d in range(1, depth + 1)])

    @classmethod
    def default(cls) -> StaticTreePolicy:
        """The 16-node ``DEFAULT_TREE``."""
        return cls(DEFAULT_TREE)

    def expand_plan(self, builder: TreeBuilder, level: int) -> dict[int, int]:
        parents = [-1] if level == 0 else builder.level(level)
        plan: dict[int, int] = {}
        for node in parents:
            ranks = () if node < 0 else builder.rank_path(node)
            if ranks in self._fanout:
                plan[node] = self._fanout[ranks]
        return plan

    def build(self, builder: TreeBuilder) -> TokenTree:
        return builder.build(self.max_nodes)


class DynamicTreePolicy(TreePolicy):
    """EAGLE-2 dynamic tree (Li et al. 2024): expand the most likely frontier, then rerank.

    Level 0 draws ``branching`` children of the root; every later level takes
    the ``branching`` nodes of the newest level with the highest cumulative
    draft log-prob and draws ``branching`` children of each. ``build`` keeps
    the ``budget`` best nodes, closed under ancestors and elder siblings: by
    cumulative log-prob for deterministic drafts (EAGLE-2), by the
    probability that verification tries the node for sampled drafts (see
    ``TreeBuilder._select`` for why sampled drafts cannot use their own
    token's probability).
    """

    def __init__(self, depth: int, branching: int, budget: int) -> None:
        if depth < 1 or branching < 1 or budget < 1:
            raise ValueError(
                f"depth, branching and budget must be >= 1, got {depth}, {branching}, {budget}"
            )
        self.depth = depth
        self.branching = branching
        self.budget = budget
        self.max_nodes = budget

    def expand_plan(self, builder: TreeBuilder, level: int) -> dict[int, int]:
        if level == 0:
            return {-1: self.branching}
        return {node: self.branching for node in builder.best(builder.level(level), self.branching)}

    def build(self, builder: TreeBuilder) -> TokenTree:
        return builder.build(self.budget)


def tree_policy(depth: int, branching: int, budget: int) -> TreePolicy:
    """A chain of `depth` for branching 1, else a dynamic tree of at most `budget` nodes."""
    if branching == 1:
        return StaticTreePolicy.chain(depth)
    return DynamicTreePolicy(depth, branching, budget)
