"""The draft token tree: one representation used everywhere.

A tree holds the *draft* nodes only. Node ``i`` carries ``tokens[i]`` and hangs
off ``parents[i]``; ``parents[i] == -1`` means it hangs off the implicit root,
the last committed token, which the target feeds in the same forward. Nodes are
in topological order (``parents[i] < i``), and siblings appear in the order they
were drawn, elder first. Several nodes may hang off the root (a forest).

Everything else (attention mask, positions, leaf paths, child lists) is derived
from ``parents`` by the functions below.

Optional sampling info makes stochastic verification lossless: row ``i`` of
``q_tokens``/``q_probs`` is the sparse distribution node ``i``'s token was drawn
from, conditional on its elder siblings already drawn (for sampling without
replacement: the draft distribution with elder siblings removed, renormalised).
Padding entries have probability 0. Without it (``q_tokens is None``) the draft
was deterministic and each node's distribution is one-hot on its own token.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class TreeError(ValueError):
    """A malformed token tree; the message names the offending index and the rule."""


def _check_parents(parents: torch.Tensor) -> None:
    """Raise TreeError unless ``parents`` is a LongTensor[N] with parents[i] in [-1, i)."""
    if not isinstance(parents, torch.Tensor):
        raise TreeError(f"parents must be a torch.Tensor, got {type(parents).__name__}")
    if parents.dtype != torch.long or parents.dim() != 1:
        raise TreeError(
            f"parents must be a 1-D LongTensor, got dtype={parents.dtype} "
            f"shape={tuple(parents.shape)}"
        )
    n = parents.shape[0]
    if n == 0:  # nothing to check (a round without a draft: every round, with speculation off)
        return
    index = torch.arange(n, device=parents.device)  # (N,)
    bad = (parents < -1) | (parents >= index)  # (N,)
    if bad.any():
        i = int(bad.nonzero()[0])
        p = int(parents[i])
        if p >= i:
            raise TreeError(
                f"node {i}: parent {p} is not an earlier node (need -1 <= parent < {i}); "
                "nodes must be in topological order, so this is a cycle or forward reference"
            )
        raise TreeError(f"node {i}: parent {p} is out of range (need -1 <= parent < {i})")


@dataclass(frozen=True, eq=False)
class TokenTree:
    """Draft nodes of one speculation round, in topological order.

    Construction checks shapes, dtypes and the parent structure; the
    vocabulary-dependent checks live in :func:`validate_tree`.
    """

    tokens: torch.Tensor  # (N,) long: the draft token of each node
    parents: torch.Tensor  # (N,) long: parent node index, -1 for children of the root
    q_tokens: torch.Tensor | None = None  # (N, K) long: support of each node's draw
    q_probs: torch.Tensor | None = None  # (N, K) float: probabilities on that support

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, torch.Tensor):
            raise TreeError(f"tokens must be a torch.Tensor, got {type(self.tokens).__name__}")
        if self.tokens.dtype != torch.long or self.tokens.dim() != 1:
            raise TreeError(
                f"tokens must be a 1-D LongTensor, got dtype={self.tokens.dtype} "
                f"shape={tuple(self.tokens.shape)}"
            )
        _check_parents(self.parents)
        n = self.tokens.shape[0]
        if self.parents.shape[0] != n:
            raise TreeError(f"tokens has {n} nodes but parents has {self.parents.shape[0]}")
        if (self.q_tokens is None) != (self.q_probs is None):
            raise TreeError("q_tokens and q_probs must be given together or not at all")
        if self.q_tokens is None:
            return
        assert self.q_probs is not None
        if self.q_tokens.dtype != torch.long or self.q_tokens.dim() != 2:
            raise TreeError(
                f"q_tokens must be a 2-D LongTensor (N, K), got dtype={self.q_tokens.dtype} "
                f"shape={tuple(self.q_tokens.shape)}"
            )
        if not self.q_probs.is_floating_point() or self.q_probs.dim() != 2:
            raise TreeError(
                f"q_probs must be a 2-D float tensor (N, K), got dtype={self.q_probs.dtype} "
                f"shape={tuple(self.q_probs.shape)}"
            )
        if self.q_tokens.shape != self.q_probs.shape:
            raise TreeError(
                f"q_tokens {tuple(self.q_tokens.shape)} and q_probs "
                f"{tuple(self.q_probs.shape)} differ in shape"
            )
        if self.q_tokens.shape[0] != n or (n > 0 and self.q_tokens.shape[1] == 0):
            raise TreeError(
                f"q rows must have shape (N={n}, K>=1), got {tuple(self.q_tokens.shape)}"
            )

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def sampled(self) -> bool:
        """True when the tree carries the draft's sampling distributions."""
        return self.q_tokens is not None

    @classmethod
    @functools.cache
    def empty(cls) -> TokenTree:
        """A tree with no draft nodes: verification then emits one target token. Every
        round without a draft takes one, so there is one: it holds nothing to change."""
        none = torch.empty(0, dtype=torch.long)  # (0,): holds nothing, so both may share it
        return cls(tokens=none, parents=none)

    def head(self, n: int) -> TokenTree:
        """The first `n` nodes: a tree too, since every node's parent comes before it."""
        if n >= len(self):
            return self
        q_tokens = None if self.q_tokens is None else self.q_tokens[:n]
        q_probs = None if self.q_probs is None else self.q_probs[:n]
        return TokenTree(self.tokens[:n], self.parents[:n], q_tokens, q_probs)

    @classmethod
    def chain(cls, tokens: Sequence[int] | torch.Tensor) -> TokenTree:
        """A single path: node i is the child of node i-1 (node 0 of the root)."""
        toks = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)  # (N,)
        parents = torch.arange(toks.shape[0], device=toks.device) - 1  # (N,)
        return cls(tokens=toks, parents=parents)


def validate_tree(tree: TokenTree, vocab_size: int, max_nodes: int | None = None) -> None:
    """Check a tree against a vocabulary and a node budget; raise TreeError if malformed.

    Rules: token ids in [0, vocab_size); parents in [-1, i) (checked at
    construction); N <= max_nodes; when q rows are present, each row is
    non-negative, sums to 1 (to a dtype-dependent tolerance), has its token ids
    in the vocabulary, and gives the node's own token probability > 0 (a token
    cannot have been drawn from a distribution that excludes it).
    """
    if vocab_size < 1:
        raise TreeError(f"vocab_size must be >= 1, got {vocab_size}")
    n = len(tree)
    if max_nodes is not None and n > max_nodes:
        raise TreeError(f"tree has {n} nodes, over the budget of {max_nodes}")
    if n == 0:
        return
    out = (tree.tokens < 0) | (tree.tokens >= vocab_size)  # (N,)
    if out.any():
        i = int(out.nonzero()[0])
        raise TreeError(f"node {i}: token {int(tree.tokens[i])} outside vocab [0, {vocab_size})")
    if tree.q_tokens is None or tree.q_probs is None:
        return

    q_tokens, q_probs = tree.q_tokens, tree.q_probs.float()  # (N, K), (N, K)
    k = q_tokens.shape[1]
    bad_tok = ((q_tokens < 0) | (q_tokens >= vocab_size)).any(dim=1)  # (N,)
    if bad_tok.any():
        i = int(bad_tok.nonzero()[0])
        raise TreeError(f"node {i}: q_tokens has an id outside vocab [0, {vocab_size})")
    bad_prob = ~torch.isfinite(q_probs).all(dim=1) | (q_probs < 0).any(dim=1)  # (N,)
    if bad_prob.any():
        i = int(bad_prob.nonzero()[0])
        raise TreeError(f"node {i}: q_probs must be finite and non-negative")
    tol = max(1e-4, k * torch.finfo(tree.q_probs.dtype).eps)
    sums = q_probs.sum(dim=1)  # (N,)
    off = (sums - 1).abs() > tol  # (N,)
    if off.any():
        i = int(off.nonzero()[0])
        raise TreeError(f"node {i}: q_probs sums to {float(sums[i]):.6f}, not 1 (tol {tol:g})")
    own = ((q_tokens == tree.tokens[:, None]) * q_probs).sum(dim=1)  # (N,)
    zero = own <= 0  # (N,)
    if zero.any():
        i = int(zero.nonzero()[0])
        raise TreeError(
            f"node {i}: its token {int(tree.tokens[i])} has probability 0 in its own q row"
        )


def depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of each node; children of the root have depth 1.

    The position of node i in the sequence is ``root_position + depths[i]``.
    One pass in node order: a parent comes before its children.
    """
    _check_parents(parents)
    depth: list[int] = []
    for p in parents.tolist():
        depth.append(1 if p < 0 else depth[p] + 1)
    return torch.tensor(depth, dtype=torch.long, device=parents.device)  # (N,)


def tree_mask(parents: torch.Tensor) -> torch.Tensor:
    """Attention mask among draft nodes: mask[i, j] is True iff j is i or an ancestor of i.

    Every node also sees the committed prefix (including the root); that part
    of the mask is the caller's. Numbering the nodes in depth-first order, j's
    subtree is the numbers from j's own to j's plus its size, so j is i or an
    ancestor of i exactly when i's number falls in that range: a few passes over
    the nodes and one comparison, where walking up a level at a time cost a
    prefill's chain of 130 tokens 130 rounds of tensor ops.
    """
    kids = children(parents)  # checks parents
    n = parents.shape[0]
    size = [1] * n
    for i, p in reversed(list(enumerate(parents.tolist()))):  # children after their parent
        if p >= 0:
            size[p] += size[i]
    first, stack = [0] * n, list(reversed(kids[0]))
    for number in range(n):
        i = stack.pop()
        first[i] = number
        stack.extend(reversed(kids[i + 1]))
    begin = torch.tensor(first, device=parents.device)  # (N,)
    end = begin + torch.tensor(size, device=parents.device)  # (N,)
    return (begin[None, :] <= begin[:, None]) & (begin[:, None] < end[None, :])  # (N, N)


def children(parents: torch.Tensor) -> list[list[int]]:
    """Child lists: entry 0 is the root's children, entry i+1 node i's, in index order."""
    _check_parents(parents)
    kids: list[list[int]] = [[] for _ in range(parents.shape[0] + 1)]
    for i, p in enumerate(parents.tolist()):
        kids[p + 1].append(i)
    return kids


def path_to(parents: torch.Tensor, i: int) -> list[int]:
    """Node indices from the root's child down to node i, inclusive."""
    _check_parents(parents)
    n = parents.shape[0]
    if not 0 <= i < n:
        raise TreeError(f"node {i} is not in a tree of {n} nodes")
    par = parents.tolist()
    path = [i]
    while par[path[-1]] >= 0:
        path.append(par[path[-1]])
    return path[::-1]


def leaf_paths(parents: torch.Tensor) -> list[list[int]]:
    """Root-to-leaf node index paths, in depth-first order with children in index order.

    That order is lexicographic over paths, so among equal-length paths the one
    through elder siblings comes first.
    """
    kids = children(parents)
    paths: list[list[int]] = []
    stack: list[list[int]] = [[c] for c in reversed(kids[0])]
    while stack:
        path = stack.pop()
        below = kids[path[-1] + 1]
        if not below:
            paths.append(path)
        stack.extend(path + [c] for c in reversed(below))
    return paths


def check_tokens(tokens: Sequence[int], vocab_size: int) -> None:
    """Raises ValueError unless every id is in [0, vocab_size)."""
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


def spine(tree: TokenTree) -> list[int]:
    """Tokens along the tree's first-child path from the root (the draft's best path)."""
    tokens, out, at = tree.tokens.tolist(), [], -1
    for i, parent in enumerate(tree.parents.tolist()):
        if parent == at:  # the first child of `at` (children come after their parent)
            out.append(tokens[i])
            at = i
    return out


def subtree(tree: TokenTree, path: Sequence[int], budget: int) -> TokenTree | None:
    """The nodes below the node reached by `path` (tokens from the root), as a tree.

    At most `budget` nodes, kept in the original order (topological, elder
    siblings first), so the kept set stays closed under ancestors and elder
    siblings. None when `path` is not in the tree or nothing lies below it.
    """
    parents = tree.parents.tolist()
    tokens = tree.tokens.tolist()
    at: int | None = -1
    for token in path:
        children = (i for i in range(at + 1, len(parents)) if parents[i] == at)
        at = next((i for i in children if tokens[i] == token), None)
        if at is None:
            return None
    new_index = {at: -1}  # the reached node becomes the new root
    kept: list[int] = []
    for i in range(at + 1, len(parents)):
        if parents[i] in new_index and len(kept) < budget:
            new_index[i] = len(kept)
            kept.append(i)
    if not kept:
        return None
    index = torch.tensor(kept, dtype=torch.long)  # (M,)
    new_parents = torch.tensor([new_index[parents[i]] for i in kept], dtype=torch.long)  # (M,)
    q_tokens = tree.q_tokens[index] if tree.q_tokens is not None else None  # (M, K)
    q_probs = tree.q_probs[index] if tree.q_probs is not None else None  # (M, K)
    return TokenTree(tree.tokens[index], new_parents, q_tokens, q_probs)


def merge_trees(first: TokenTree, second: TokenTree, budget: int) -> TokenTree:
    """One tree holding both drafts (a hybrid round: n-gram first, then the model's).

    `first`'s nodes come first, in their order, then `second`'s in theirs; at
    most `budget` nodes, each kept with its parent (a node whose parent was cut
    is cut too), so the result stays topological.

    - Both deterministic (no q rows): a trie union. A node of `second` whose
      token equals a child of the same (merged) parent is that child: the
      target verifies each candidate path once.
    - Either sampled: no de-duplication, a forest: `first`'s roots are the
      elder siblings, `second`'s come after; a deterministic side gets one-hot
      q rows, both sides padded with probability-0 entries to the wider K.
      Lossless (see `stochastic_verify`): each sibling is still drawn from its
      recorded q row given its elder siblings, since a deterministic draft's
      token is a fixed function of the history (one-hot), and `second` drew
      its nodes knowing nothing of `first`'s. A duplicate of a rejected elder
      is rejected with certainty (the residual has no mass on a rejected
      one-hot token): wasted, never wrong. Merging it into the elder instead
      would be lossy: the later siblings' rows would no longer be what they
      were drawn from (tests/speculation/test_lossless.py shows it caught).
    """
    return _union(first, second, budget, dedupe=not (first.sampled or second.sampled))


def _union(first: TokenTree, second: TokenTree, budget: int, dedupe: bool) -> TokenTree:
    """`merge_trees` with de-duplication chosen by the caller."""
    parents: list[int] = []  # merged parent of each kept node
    source: list[tuple[TokenTree, int]] = []  # (tree, index) of each kept node
    child: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
    for tree in (first, second):
        # where each node of `tree` went in the merge; -1: the root, None: cut
        placed: list[int | None] = []
        tokens = tree.tokens.tolist()
        for i, parent in enumerate(tree.parents.tolist()):
            at = -1 if parent < 0 else placed[parent]
            same = child.get((at, tokens[i])) if dedupe else None
            if same is not None:
                placed.append(same)
            elif at is None or len(parents) >= budget:
                placed.append(None)
            else:
                placed.append(len(parents))
                child[(at, tokens[i])] = len(parents)
                parents.append(at)
                source.append((tree, i))
    tokens = torch.tensor([int(t.tokens[i]) for t, i in source], dtype=torch.long)  # (N,)
    new_parents = torch.tensor(parents, dtype=torch.long)  # (N,)
    if not (first.sampled or second.sampled):
        return TokenTree(tokens, new_parents)
    k = max(t.q_tokens.shape[1] for t in (first, second) if t.q_tokens is not None)
    rows = [_q_row(t, i, k) for t, i in source]
    q_tokens = torch.stack([r[0] for r in rows]) if rows else torch.empty(0, k, dtype=torch.long)
    q_probs = torch.stack([r[1] for r in rows]) if rows else torch.empty(0, k)
    return TokenTree(tokens, new_parents, q_tokens, q_probs)  # q: (N, K), (N, K)


def _q_row(tree: TokenTree, i: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Node i's q row padded to width k with probability-0 entries: (k,) long, (k,) float.
    A deterministic node's row is one-hot on its token."""
    if tree.q_tokens is None or tree.q_probs is None:
        tokens, probs = tree.tokens[i : i + 1], torch.ones(1)  # (1,), (1,)
    else:
        tokens, probs = tree.q_tokens[i], tree.q_probs[i].float()  # (K',), (K',)
    pad = k - tokens.shape[0]
    # padding repeats the row's first token with probability 0 (verify adds, not assigns)
    return (
        torch.cat([tokens, tokens[:1].expand(pad)]),
        torch.cat([probs, torch.zeros(pad)]),
    )
