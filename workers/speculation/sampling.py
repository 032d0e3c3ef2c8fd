"""Sampling parameters and the one logits -> probabilities transform.

Plain sampling and speculative verification both call :func:`target_probs`, so
"lossless" means equal to exactly this distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next-token distribution is shaped before sampling."""

    temperature: float = 0.0  # 0 = greedy (argmax); otherwise logits are divided by it
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    seed: int | None = None  # seed for the request's generator; None = nondeterministic
    min_p: float = 0.0  # keep tokens at least this share of the likeliest's probability; 0 = off

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, type(None))):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if not 0 <= self.min_p <= 1:  # also rejects NaN
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax (temperature 0)."""
        return self.temperature == 0

    @property
    def seeded(self) -> bool:
        """True for a sampled request with a seed: its text may depend on nothing but the
        request, and which tokens a round drafts decides how its random stream is used, so
        its drafts must not depend on other sessions, the target's load or timing."""
        return not self.greedy and self.seed is not None


def cpu_array(x: torch.Tensor) -> np.ndarray | None:
    """A float32 CPU tensor's numpy view (no copy), None for any other: numpy's reductions
    over a row of the vocabulary are vectorised where torch's, on one thread, are not
    (argmax 3-6 µs against 43-85, a NaN/inf check 8-10 against 76-205; bench/RESULTS.md),
    and a target round takes them per node and after the root."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return x.detach().numpy()
    return None


def first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (...,) long on the CPU: each row's first largest entry (NaN counting as
    largest), as torch.argmax."""
    array = cpu_array(logits)
    if array is not None:
        return torch.as_tensor(array.argmax(axis=-1))  # a 0-d result too
    return logits.argmax(dim=-1).cpu()


def row_max(x: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (...,) on the CPU: each row's largest entry, NaN where it has one (numpy's
    max and torch's amax both propagate NaN): one pass where checking for NaN, +inf and a
    finite entry took four."""
    array = cpu_array(x)
    if array is not None:
        return torch.as_tensor(array.max(axis=-1))
    return x.amax(dim=-1).cpu()


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits (..., V) float32 divided by a temperature > 0, the likeliest shifted to 0, so a
    tiny temperature sends the others to -inf instead of making NaN."""
    temperature = max(temperature, torch.finfo(logits.dtype).tiny)
    return (logits - logits.amax(dim=-1, keepdim=True)) / temperature  # (..., V)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Next-token probabilities (..., V) from logits (..., V), in float32.

    Order (vLLM's): temperature, then min-p (tokens whose probability is below
    min_p times the likeliest's), then top-k (ties with the k-th logit are kept),
    then top-p over what is left (the smallest set of most likely tokens whose
    mass reaches top_p, always at least one), then renormalise. Temperature 0 gives a one-hot on
    the argmax (the first on ties). Logits may contain -inf (masked tokens) but
    no NaN or +inf, and every row needs at least one finite entry.
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise ValueError("logits must be a floating-point tensor")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape (..., V) with V >= 1, got {tuple(logits.shape)}")
    x = logits.float()  # (..., V)
    tops = row_max(x).reshape(-1).tolist()  # each row's largest, NaN where it has one
    if any(math.isnan(top) or top == math.inf for top in tops):
        raise ValueError("logits contain NaN or +inf")
    if -math.inf in tops:
        raise ValueError("a row of logits has no finite entry")

    if params.greedy:
        top = first_argmax(x).unsqueeze(-1).to(x.device)  # (..., 1)
        return torch.zeros_like(x).scatter_(-1, top, 1.0)  # (..., V)

    x = tempered(x, params.temperature)  # (..., V), the likeliest at 0
    if params.min_p > 0:  # p < min_p * p_max  <=>  x - x_max < log(min_p)
        x = x.masked_fill(x < math.log(params.min_p), float("-inf"))  # (..., V)
    v = x.shape[-1]
    if 0 < params.top_k < v:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]  # (..., 1)
        x = x.masked_fill(x < kth, float("-inf"))  # (..., V)
    probs = torch.softmax(x, dim=-1)  # (..., V)
    if params.top_p < 1:
        keep = top_p_mask(probs, params.top_p)  # (..., V)
        probs = probs * keep  # (..., V)
        probs = probs / probs.sum(dim=-1, keepdim=True)  # (..., V)
    return probs


# candidates `top_p_mask` tries before sorting a whole row: a language model's top-p set is
# a few to a few hundred tokens (SmolLM2 at temperature 0.7-1.0, top_p 0.9-0.95: median
# 2-14, at most 492 over 80 positions)
TOP_P_CANDIDATES = (64, 1024)
# how far past top_p the candidates' mass must reach to settle every other token's fate,
# against float32 rounding (its sum and the full sort's running sums round differently)
TOP_P_MARGIN = 1e-5


def top_p_mask(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """(..., V) -> (..., V) bool: the smallest set of most likely tokens whose mass reaches
    top_p, at least one; among equal probabilities the lower id first.

    The rule (`_top_p_sorted`): sort a row by probability (stable, so ties keep id order)
    and keep each token whose mass before it (the running float32 sum, less its own) is
    below top_p. Sorting all 49,152 tokens costs 4-6 ms a row on one CPU thread; the set is
    rarely more than a few hundred, so on the CPU each row first takes its k most likely
    tokens (with every token tied with the k-th) and sorts only those: the running sums of
    a sorted prefix are the full sort's (one sum after another, in the same order), and
    once the candidates' mass reaches top_p with a margin, every other token would have
    been dropped. The same set as sorting the whole row, bit for bit; a row whose
    candidates fall short is sorted whole. Elsewhere (a GPU) the rows are sorted whole in
    one batched call, cheaper there than a few small calls and a sync per row.
    """
    if probs.device.type != "cpu":
        return _top_p_whole(probs, top_p)
    v = probs.shape[-1]
    rows = probs.reshape(-1, v)  # (R, V)
    keep = torch.zeros_like(rows, dtype=torch.bool)  # (R, V)
    for r, row in enumerate(rows):
        for k in (k for k in TOP_P_CANDIDATES if k < v):
            kth = row.topk(k).values[-1]
            ids = (row >= kth).nonzero().squeeze(1)  # (C,) C >= k, in id order
            sorted_p, order = row[ids].sort(descending=True, stable=True)  # (C,) x2
            if float(sorted_p.sum()) >= top_p + TOP_P_MARGIN:  # no other token could count
                keep[r, ids[order[_top_p_sorted(sorted_p, top_p)]]] = True
                break
        else:
            keep[r] = _top_p_whole(row, top_p)
    return keep.reshape(probs.shape)


def _top_p_whole(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`top_p_mask` by sorting every token of every row: (..., V) -> (..., V) bool."""
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)  # (..., V) x2
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(
        -1, order, _top_p_sorted(sorted_p, top_p)
    )


def _top_p_sorted(sorted_p: torch.Tensor, top_p: float) -> torch.Tensor:
    """(..., C) probabilities sorted high to low -> (..., C) bool: those top-p keeps."""
    keep = sorted_p.cumsum(dim=-1) - sorted_p < top_p  # mass of strictly likelier below top_p
    keep[..., 0] = True  # the likeliest, even when top_p rounds to 0 in float32
    return keep


def make_generator(seed: int | None = None) -> torch.Generator:
    """A CPU generator, seeded from ``seed`` or nondeterministically when None.

    All randomness in speculation (draft draws, accept coins, bonus draws) comes
    from one such generator per request, so a seeded request is reproducible.
    """
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def uniform(generator: torch.Generator) -> float:
    """One draw from U[0, 1) off the CPU generator."""
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from probs (V,) by inverse CDF with one uniform from ``generator``.

    ``probs`` may live on any device and need not be normalised; the draw is
    made on the CPU in float64 so it is the same for a seed on every device.
    A token with probability 0 is never returned.
    """
    if not isinstance(probs, torch.Tensor) or probs.dim() != 1 or probs.shape[0] < 1:
        raise ValueError("probs must be a 1-D tensor with at least one entry")
    p = probs.detach().to(device="cpu", dtype=torch.float64)  # (V,)
    cdf = p.cumsum(dim=0)  # (V,)
    total = float(cdf[-1])
    if not 0 < total < float("inf") or p.numpy().min() < 0:  # NaN: total is NaN
        raise ValueError(f"probs must be finite, non-negative, with positive mass (sum {total})")
    x = torch.tensor([uniform(generator) * total], dtype=torch.float64)  # (1,)
    i = int(torch.searchsorted(cdf, x, right=True))  # first index with cdf > x
    if i >= p.shape[0]:  # x rounded up to the total: take the last token with mass
        i = int((p > 0).nonzero()[-1])
    return i


DRAFT_STREAM, TARGET_STREAM = 1, 2  # independent random streams of one round


def round_generator(params: SamplingParams, position: int, stream: int) -> torch.Generator | None:
    """A generator for one round, derived from (seed, position, stream) so that a
    replayed session (failover, eviction) draws the same numbers at the same place.

    Draft and target must draw from different streams: if the draft's samples
    and the target's acceptance tests shared random numbers they would be
    correlated, and verification would no longer be lossless."""
    if params.greedy:
        return None
    if params.seed is None:
        return make_generator(None)
    return make_generator((params.seed * 1_000_003 + position * 4 + stream) % (2**63))
