"""Prompt-lookup drafting: a token tree from earlier occurrences of the current suffix.

Prompt lookup decoding (Saxena 2023) copies the tokens that followed an
earlier occurrence of the last few tokens. Here several earlier occurrences
are merged into a trie, so one round verifies all their continuations at once
(a deterministic draft: the tree carries no q rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.spec.tree import TokenTree


def _continuations(
    history: list[int], max_ngram: int, min_ngram: int, depth: int, max_matches: int
) -> list[list[int]]:
    """Up to ``depth`` tokens after each earlier occurrence of the longest matching suffix.

    n runs from max_ngram down to min_ngram and stops at the first n with a
    match. Occurrences are listed most recent first and must be followed by at
    least one token (so the suffix itself never matches). O(len(history)).
    """
    last = history[-1]
    # end positions of candidate occurrences, most recent first
    ends = [e for e in range(len(history) - 2, -1, -1) if history[e] == last]
    for n in range(max_ngram, min_ngram - 1, -1):
        suffix = history[-n:]
        found = [e for e in ends if e >= n - 1 and history[e - n + 1 : e + 1] == suffix]
        if found:
            return [history[e + 1 : e + 1 + depth] for e in found[:max_matches]]
    return []


def ngram_tree(
    history: Sequence[int] | torch.Tensor,
    max_ngram: int = 3,
    min_ngram: int = 1,
    depth: int = 8,
    budget: int = 16,
    max_matches: int = 8,
    window: int = 4096,
) -> TokenTree:
    """Draft tree from up to ``max_matches`` earlier continuations of the history's suffix.

    Rules:
    - match the longest suffix n-gram, n from max_ngram down to min_ngram, in
      the last ``window`` tokens only (bounds the cost on long histories);
    - each match contributes the next ``depth`` tokens; continuations merge
      into a trie where they share a prefix; a node's *support* is the number
      of matches through it and its *recency* the rank of the most recent one;
    - siblings are ordered by support (more first), then recency;
    - at most ``budget`` nodes are kept, by (support desc, recency, depth).
      That order puts every node after its parent (support never grows and
      recency never improves down a path) and after its elder siblings, so the
      kept prefix is closed under ancestors and elder siblings; nodes are
      numbered in that order, which is topological.
    Returns the empty tree when nothing matches.
    """
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
    if depth < 1 or budget < 0 or max_matches < 1 or window < 2:
        raise ValueError(
            "need depth >= 1, budget >= 0, max_matches >= 1, window >= 2; got "
            f"depth={depth} budget={budget} max_matches={max_matches} window={window}"
        )
    hist = history.tolist() if isinstance(history, torch.Tensor) else list(history)
    hist = hist[-window:]
    if len(hist) < 2 or budget == 0:
        return TokenTree.empty()
    conts = _continuations(hist, max_ngram, min_ngram, depth, max_matches)
    if not conts:
        return TokenTree.empty()

    # trie over the continuations; rank 0 is the most recent match
    token: list[int] = []
    parent: list[int] = []
    support: list[int] = []
    recency: list[int] = []
    level: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for rank, cont in enumerate(conts):
        at = -1
        for d, tok in enumerate(cont):
            node = index.get((at, tok))
            if node is None:
                node = len(token)
                index[(at, tok)] = node
                token.append(tok)
                parent.append(at)
                support.append(0)
                recency.append(rank)
                level.append(d + 1)
            support[node] += 1
            at = node

    order = sorted(range(len(token)), key=lambda i: (-support[i], recency[i], level[i]))
    kept = order[:budget]
    new_index = {old: new for new, old in enumerate(kept)}
    tokens = torch.tensor([token[i] for i in kept], dtype=torch.long)  # (N,)
    parents = torch.tensor(  # (N,)
        [new_index[parent[i]] if parent[i] >= 0 else -1 for i in kept], dtype=torch.long
    )
    return TokenTree(tokens=tokens, parents=parents)
