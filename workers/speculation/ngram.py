"""Prompt-lookup drafting: a token tree from earlier occurrences of the current suffix.

Prompt lookup decoding (Saxena 2023) copies the tokens that followed an
earlier occurrence of the last few tokens. Here several earlier occurrences
are merged into a trie, so one round verifies all their continuations at once
(a deterministic draft: the tree carries no q rows).

Which nodes a budget keeps is decided as EAGLE-2 ranks a model draft's
nodes: by an estimate of the probability that verification reaches them.
Each match votes for its continuation with weight RECENCY_DECAY ** rank (rank
0 = the most recent match); a trie edge is taken with the share of its
parent's votes that go through it; every level costs a factor COPY_PROB more
(a copied run ends somewhere). So the most recent, best supported
continuation forms the spine, and alternatives at early divergence points
outrank the spine's deepest tokens.

Continuations found elsewhere (the suffix cache of other requests' outputs,
workers/draft/suffix.py) join the same trie with the votes SHARED_WEIGHT *
RECENCY_DECAY ** rank, below the session's own matches of the same rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from workers.speculation.tree import TokenTree

MAX_NGRAM = 3  # the longest suffix matched
WINDOW = 4096  # the last tokens searched
RECENCY_DECAY = 0.7  # vote of a match relative to the next more recent one
COPY_PROB = 0.8  # chance that a copied run goes on for one more token
SHARED_WEIGHT = 0.5  # vote of another request's continuation relative to the session's own
# `SuffixIndex.extend` of more tokens than this goes n by n (a prompt, a history re-sent):
# faster from about 6 tokens on, slower for a round's one or two
BULK = 8


class SuffixIndex:
    """Where each n-gram (n <= max_ngram) of a growing history ended, once a token followed
    it: prompt lookup's matches at O(max_ngram) a token appended and O(max_ngram + matches)
    a lookup, where a scan of the history costs O(len(history)) every round (14 / 45 µs at
    300 / 1,500 tokens here). An occurrence counts while it starts within the last `window`
    tokens. The n-gram drafter keeps one per session, the gateway one per session for each
    round's match length."""

    def __init__(self, max_ngram: int = MAX_NGRAM, window: int = WINDOW):
        self.max_ngram = max_ngram
        self.window = window
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> where it ended, in order

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Appends tokens: the n-grams ending before each now have a token after them."""
        if len(tokens) > BULK:
            self._extend_bulk(tokens)
            return
        history, ends = self.tokens, self.ends
        for token in tokens:
            end = len(history) - 1
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                key = tuple(history[end - n + 1 :])
                found = ends.get(key)
                if found is None:
                    ends[key] = [end]
                else:
                    found.append(end)
            history.append(token)

    def _extend_bulk(self, tokens: Sequence[int]) -> None:
        """`extend` n by n: each n's grams built by one zip over shifted slices (a prompt
        indexes in 0.43 µs a token here, against 0.98 token by token); each gram's ends
        still come in order, and grams of different n never share a key."""
        history, ends = self.tokens, self.ends
        start = len(history)
        history.extend(tokens)
        size = len(history)
        for n in range(1, self.max_ngram + 1):
            first = max(start - 1, n - 1)  # the first end that gains a next token
            if first > size - 2:  # none: the last end (size - 2) is before it
                continue
            shifted = [history[first - n + 1 + k : size - n + k] for k in range(n)]
            for end, key in enumerate(zip(*shifted, strict=True), first):
                found = ends.get(key)
                if found is None:
                    ends[key] = [end]
                else:
                    found.append(end)

    def truncate(self, size: int) -> None:
        """Drops the tokens past `size` (a draft's history that ran ahead on a guess)."""
        history, ends = self.tokens, self.ends
        while len(history) > size:
            history.pop()
            end = len(history) - 1  # the n-grams that ended here lose their next token
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                key = tuple(history[end - n + 1 :])
                found = ends[key]
                found.pop()  # the latest end: later ones were dropped first
                if not found:
                    del ends[key]

    def matches(
        self, max_ngram: int | None = None, min_ngram: int = 1, limit: int = 1
    ) -> tuple[int, list[int]]:
        """The longest suffix n-gram, n from max_ngram down to min_ngram, that occurred
        before within the window, and where up to `limit` of those occurrences end (each
        followed by a token, so the suffix itself never matches), most recent first; (0,
        []) when none has."""
        history, size = self.tokens, len(self.tokens)
        longest = min(max_ngram or self.max_ngram, self.max_ngram, size - 1)
        for n in range(longest, min_ngram - 1, -1):
            found = self.ends.get(tuple(history[size - n :]), ())
            first = size - self.window + n - 1  # the earliest end of an occurrence in the window
            recent = []
            for end in reversed(found):
                if end < first or len(recent) == limit:
                    break
                recent.append(end)
            if recent:
                return n, recent
        return 0, []

    def agreement(self, limit: int) -> int:
        """How far back the history's end agrees with the latest earlier occurrence of its
        longest matched suffix (`matches`), counted up to `limit` tokens (0: no match): a
        long agreement predicts a copied run. On the bench's grounded answers the lookup's
        first token was right 0.93-1.00 of the time where 6 tokens or more agreed, 0.80-0.83
        where 3-5 did (bench/runs/2026-11-29-sampled-lookup/match-length.txt)."""
        agreed, ends = self.matches()
        if not agreed:
            return 0
        tokens, last, end = self.tokens, len(self.tokens) - 1, ends[0]
        while agreed < limit and end >= agreed and tokens[end - agreed] == tokens[last - agreed]:
            agreed += 1
        return agreed

    def match_length(self, max_ngram: int | None = None, min_ngram: int = 1) -> int:
        """The n of the suffix `ngram_tree` copies after (0: no match): a long match predicts
        a copied run far better than a one-token one (`specsplit bench ceiling` counts
        both)."""
        return self.matches(max_ngram, min_ngram)[0]


def index_of(
    history: Sequence[int] | torch.Tensor, max_ngram: int = MAX_NGRAM, window: int = WINDOW
) -> SuffixIndex:
    """A SuffixIndex over the last `window` tokens of `history`."""
    tokens = history.tolist() if isinstance(history, torch.Tensor) else list(history)
    index = SuffixIndex(max_ngram, window)
    index.extend(tokens[-window:])
    return index


def match_length(
    history: Sequence[int], max_ngram: int = MAX_NGRAM, min_ngram: int = 1, window: int = WINDOW
) -> int:
    """`SuffixIndex.match_length` of a whole history at once."""
    return index_of(history, max_ngram, window).match_length(max_ngram, min_ngram)


def ngram_tree(
    history: SuffixIndex | Sequence[int] | torch.Tensor,
    max_ngram: int = MAX_NGRAM,
    min_ngram: int = 1,
    depth: int = 8,
    budget: int = 16,
    max_matches: int = 8,
    window: int = WINDOW,
    chain: bool = False,
    shared: Sequence[Sequence[int]] = (),
) -> TokenTree:
    """Draft tree from up to ``max_matches`` earlier continuations of the history's suffix.

    ``history``: the tokens, or a SuffixIndex of them (a drafter keeps one per session,
    so a round costs no scan of the history; its own max_ngram and window then bound
    the match, and ``window`` is not read).

    Rules:
    - match the longest suffix n-gram, n from max_ngram down to min_ngram, in
      the last ``window`` tokens only (bounds the cost on long histories);
    - each match contributes the next ``depth`` tokens; continuations merge
      into a trie where they share a prefix;
    - a node's score is its estimated log-probability of being reached (see
      the module docstring); at most ``budget`` nodes are kept, best score
      first (ties: the node made first, i.e. from the more recent match).
      A child scores strictly below its parent and siblings are numbered by
      score, so every prefix of the numbering is closed under ancestors and
      elder siblings, and the numbering is topological;
    - ``chain``: only the spine (each kept node's best child), at most
      ``budget`` tokens: the best single continuation, for a chain draft;
    - ``shared``: continuations of the same suffix found outside the history,
      best first, merged into the trie with votes SHARED_WEIGHT * RECENCY_DECAY
      ** rank (each cut to ``depth`` tokens).
    Returns the empty tree when nothing matches.
    """
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
    if depth < 1 or budget < 0 or max_matches < 1 or window < 2:
        raise ValueError(
            "need depth >= 1, budget >= 0, max_matches >= 1, window >= 2; got "
            f"depth={depth} budget={budget} max_matches={max_matches} window={window}"
        )
    if budget == 0:
        return TokenTree.empty()
    index = history if isinstance(history, SuffixIndex) else index_of(history, max_ngram, window)
    _, ends = index.matches(max_ngram, min_ngram, max_matches)
    own = [index.tokens[e + 1 : e + 1 + depth] for e in ends]
    voted = [(cont, RECENCY_DECAY**rank) for rank, cont in enumerate(own)]
    voted += [
        (list(cont[:depth]), SHARED_WEIGHT * RECENCY_DECAY**rank)
        for rank, cont in enumerate(shared)
        if len(cont)
    ]
    if not voted:
        return TokenTree.empty()
    return _trie_tree(voted, budget, chain)


def _trie_tree(voted: list[tuple[list[int], float]], budget: int, chain: bool) -> TokenTree:
    """The ``budget`` likeliest nodes of the trie over the voted continuations (see
    `ngram_tree`)."""
    token: list[int] = []
    parent: list[int] = []
    votes: list[float] = []
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for cont, weight in voted:
        at = -1
        for tok in cont:
            node = index.get((at, tok))
            if node is None:
                node = len(token)
                index[(at, tok)] = node
                token.append(tok)
                parent.append(at)
                votes.append(0.0)
            votes[node] += weight
            at = node
    root_votes = sum(weight for _, weight in voted)
    # log P(reached) = sum over the path of log(COPY_PROB * votes(node) / votes(parent));
    # parents are made before their children, so their scores are ready
    score: list[float] = []
    for i, p in enumerate(parent):
        share = votes[i] / (root_votes if p < 0 else votes[p])
        score.append(math.log(COPY_PROB * share) + (0.0 if p < 0 else score[p]))

    order = sorted(range(len(token)), key=lambda i: (-score[i], i))
    if chain:
        spine, at = [], -1
        for i in order:  # the first child of `at` in score order is its best child
            if parent[i] == at:
                spine.append(i)
                at = i
        order = spine
    kept = order[:budget]
    new_index = {old: new for new, old in enumerate(kept)}
    tokens = torch.tensor([token[i] for i in kept], dtype=torch.long)  # (N,)
    parents = torch.tensor(  # (N,)
        [new_index[parent[i]] if parent[i] >= 0 else -1 for i in kept], dtype=torch.long
    )
    return TokenTree(tokens=tokens, parents=parents)
