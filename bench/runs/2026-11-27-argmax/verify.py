"""µs a target round's greedy verification takes per session, in process, on one torch
thread (as a worker beside the bfloat16 kernel runs it), for float32 logits of the embedded
model's 49,152 tokens: torch's argmax (the verification before) against `first_argmax`
(numpy's) and the longest path walked in Python, taking turns; for a round without a draft
(1 row), a chain of 16 nodes and a binary tree of 16 (17 rows).

Usage, from a clone of the commit measured: `PYTHONPATH=$PWD python verify.py`.
"""

import functools
import timeit

import torch

from workers.speculation.sampling import first_argmax
from workers.speculation.tree import TokenTree, leaf_paths
from workers.speculation.verify import Verdict, greedy_verify

VOCAB = 49_152


def torch_verify(tree: TokenTree, logits: torch.Tensor) -> Verdict:
    """greedy_verify as it was (94eff3c): torch's argmax, and the longest path found with
    tensor ops over the padded leaf paths, even without a draft."""
    best = logits.argmax(dim=-1).cpu()
    tokens, parents = tree.tokens.cpu(), tree.parents.cpu()
    match = tokens == best[parents + 1]
    paths = leaf_paths(tree.parents)
    accepted = []
    if paths:
        width = max(len(p) for p in paths)
        padded = torch.tensor([p + [-1] * (width - len(p)) for p in paths])
        path_match = match[padded.clamp(min=0)] & (padded >= 0)
        accepted_len = path_match.long().cumprod(dim=1).sum(dim=1)
        leaf = int(accepted_len.argmax())
        accepted = paths[leaf][: int(accepted_len[leaf])]
    return Verdict(accepted=accepted, bonus=int(best[accepted[-1] + 1 if accepted else 0]))


def main() -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    shapes = {
        "no draft": [],
        "chain of 16": [-1, *range(15)],
        "binary tree of 16": [-1, -1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6],
    }
    for shape, parents in shapes.items():
        nodes = len(parents)
        tree = TokenTree(
            torch.randint(0, VOCAB, (nodes,), generator=gen),
            torch.tensor(parents, dtype=torch.long),
        )
        batch = torch.randn(8 * (nodes + 1), VOCAB, generator=gen)  # a step's logits
        logits = batch[: nodes + 1]  # one session's rows, a view as the runner's
        assert torch_verify(tree, logits) == greedy_verify(tree, logits)
        for turn in range(3):
            for name, fn in (("before", torch_verify), ("now", greedy_verify)):
                call = functools.partial(fn, tree, logits)
                us = min(timeit.repeat(call, number=100, repeat=5)) * 1e4
                print(f"{shape} ({nodes + 1} rows), turn {turn}, {name}: {us:6.1f} µs")
    x = torch.randn(1, VOCAB, generator=gen)
    for name, fn in (
        ("torch.argmax", lambda: x.argmax(dim=-1)),
        ("first_argmax", lambda: first_argmax(x)),
    ):
        print(f"one row alone, {name}: {min(timeit.repeat(fn, number=200, repeat=5)) * 5e3:.1f} µs")


if __name__ == "__main__":
    main()
