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

from gateway.pool import Worker
from workers.speculation.tree import TokenTree, subtree


@dataclass
class Lookahead:
    """A propose in flight for the round after the one being verified."""

    base: int  # history length when it started (before the round under verification)
    guess: list[int]  # the tokens it assumes that round commits first (a spine prefix)
    held_before: int  # what the draft held before the look-ahead call
    budget: int  # most nodes the next round may verify
    worker: Worker  # the draft worker asked (the session's, when it started)
    task: asyncio.Task  # -> TokenTree after history[:base] + guess

    def next_tree(self, tree: TokenTree, committed: list[int]) -> TokenTree | None:
        """The next round's tree: below the path `committed` took past the guess; else None."""
        n = len(self.guess)
        if len(committed) <= n or committed[:n] != self.guess:
            return None
        return subtree(tree, committed[n:], self.budget)

    async def result(self) -> TokenTree | Exception:
        """The look-ahead tree, or what its call failed with (a failed guess only costs
        the fresh propose)."""
        try:
            return await self.task
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - the caller decides what it says
            return error

    async def cancel(self) -> None:
        self.task.cancel()
        try:
            await self.task
        except BaseException:  # noqa: BLE001 - whatever it ended with is discarded
            pass
