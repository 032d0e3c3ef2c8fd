"""Shared builders for the spec tests."""

from __future__ import annotations

from collections.abc import Callable

import torch

from workers.speculation import (
    SamplingParams,
    TokenTree,
    TreeBuilder,
    TreePolicy,
    choose_children,
)


def random_tree(
    n: int, vocab: int, gen: torch.Generator, unique_siblings: bool = False
) -> TokenTree:
    """A random topologically ordered forest of n nodes with tokens in [0, vocab).

    With unique_siblings, no two children of one parent share a token (needs
    vocab >= n).
    """
    parents = [int(torch.randint(-1, i, (), generator=gen)) for i in range(n)]
    tokens: list[int] = []
    used: dict[int, set[int]] = {}
    for p in parents:
        taken = used.setdefault(p, set())
        while True:
            tok = int(torch.randint(0, vocab, (), generator=gen))
            if not unique_siblings or tok not in taken:
                break
        taken.add(tok)
        tokens.append(tok)
    return TokenTree(
        tokens=torch.tensor(tokens, dtype=torch.long),
        parents=torch.tensor(parents, dtype=torch.long),
    )


def run_policy(
    policy: TreePolicy,
    next_probs: Callable[[int], torch.Tensor],
    root_token: int,
    params: SamplingParams | bool,
    gen: torch.Generator | None = None,
) -> tuple[TreeBuilder, TokenTree]:
    """The draft engine's loop, with a Markov "draft model": next_probs(prev token) -> (V,)."""
    builder = TreeBuilder()
    for level in range(policy.depth):
        plan = policy.expand_plan(builder, level)
        if not plan:
            break
        for parent, k in plan.items():
            prev = root_token if parent < 0 else builder.token(parent)
            toks, q_toks, q_probs, logps = choose_children(next_probs(prev), k, params, gen)
            for j in range(toks.shape[0]):
                builder.add(
                    parent,
                    int(toks[j]),
                    float(logps[j]),
                    None if q_toks is None else q_toks[j],
                    None if q_probs is None else q_probs[j],
                )
    return builder, policy.build(builder)
