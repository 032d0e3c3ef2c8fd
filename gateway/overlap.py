"""The overlapped loop's guesswork: draft round k+1 while the target verifies round k.

While the target verifies a tree, the draft is idle; the overlapped loop asks
it for the next tree at once, after a guess of what the verification
commits: the first `j` tokens of the tree's spine (each node's eldest child,
the draft's own best path), `j` being the session's expected accepted length.
The look-ahead tree is drafted one level deeper than a round needs, so it
also holds the draft's guesses of the tokens after the guess, the target's
bonus token among them. When the round commits the guess and then a path of
the look-ahead tree, the subtree below that path is the next round's tree,
ready before the round starts; otherwise it is discarded and a fresh tree is
drafted after the real outcome.

Lossless by construction: a tree is only a proposal, and the look-ahead
tree is drafted from committed tokens only (its guess is used only when the
target committed exactly it), with the draft's own random stream,
independent of the target's acceptance tests.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from workers.spec.tree import TokenTree


def spine(tree: TokenTree) -> list[int]:
    """Tokens along the tree's first-child path from the root (the draft's best path)."""
    tokens, out, at = tree.tokens.tolist(), [], -1
    for i, parent in enumerate(tree.parents.tolist()):
        if parent == at:  # the first child of `at` (children come after their parent)
            out.append(tokens[i])
            at = i
    return out


def subtree(tree: TokenTree, path: list[int], budget: int) -> TokenTree | None:
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
    index = torch.tensor(kept, dtype=torch.long)
    new_parents = torch.tensor([new_index[parents[i]] for i in kept], dtype=torch.long)
    q_tokens = tree.q_tokens[index] if tree.q_tokens is not None else None
    q_probs = tree.q_probs[index] if tree.q_probs is not None else None
    return TokenTree(tree.tokens[index], new_parents, q_tokens, q_probs)


@dataclass
class Lookahead:
    """A propose in flight for the round after the one being verified."""

    base: int  # history length when it started (before the round under verification)
    guess: list[int]  # the tokens it assumes that round commits first (a spine prefix)
    held_before: int  # what the draft held before the look-ahead call
    budget: int  # most nodes the next round may verify
    task: asyncio.Task  # -> TokenTree after history[:base] + guess

    def next_tree(self, tree: TokenTree, committed: list[int]) -> TokenTree | None:
        """The next round's tree: below the path `committed` took past the guess; else None."""
        n = len(self.guess)
        if len(committed) <= n or committed[:n] != self.guess:
            return None
        return subtree(tree, committed[n:], self.budget)

    async def result(self) -> TokenTree | None:
        """The look-ahead tree, or None when its call failed."""
        try:
            return await self.task
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a failed guess only costs the fresh propose
            return None

    async def cancel(self) -> None:
        self.task.cancel()
        try:
            await self.task
        except BaseException:  # noqa: BLE001 - whatever it ended with is discarded
            pass
