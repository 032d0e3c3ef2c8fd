"""Batch-invariant attention in torch ops: a query's output depends on its own keys, never on
the batch. The engine's attention on any device; on a CPU, the compiled one
(workers/engine/paged_attention.py, the same property in one C loop) replaces it
where it builds (`EngineConfig.attention`).

`torch.nn.functional.scaled_dot_product_attention` on the CPU rounds a query's
output differently with the number of keys it reads (masked ones included)
and the number of queries beside it: a prompt prefilled in one forward and
fed one token at a time then leave keys and values one ulp apart, and in
bfloat16 a near-tie between the two most likely tokens flips. Here every
query reduces over its keys the same way whatever the batch looks like
(the fixed-split-size "batch-invariant" attention of He et al. 2025,
"Defeating Nondeterminism in LLM Inference"):

1. keys are cut into chunks of `chunk` positions from column 0, so a query
   with n visible keys always sees the same chunks, the last one padded;
2. a score is one dot product over the head size: a query's scores come
   from one product with all L keys, whose entries do not depend on L; each
   chunk's probability-weighted values are a product of fixed width
   (`chunk`). Every product has at least `MIN_ROWS` rows: float32 products
   of fewer rows take another kernel that rounds differently, more rows
   round each row the same (torch 2.13 CPU, MKL and oneDNN; both properties
   are tested in tests/engine/test_batch_invariance.py);
3. the softmax uses the exact maximum over all visible scores, so masked
   keys and padded chunks contribute exact zeros;
4. chunk sums are added in chunk order, one after another (`sum_chunks`),
   where chunks of zeros change nothing wherever they sit: a batch's wider
   padding, or a tree group's shared columns that only another slot reads
   (a tree node's own chunks continue after them).

The arithmetic is float32 whatever the cache's dtype. A query's keys must
sit in the same columns in every feeding pattern: visible keys first, in
sequence order. A chain reads its slot's columns as they are (`shared`); a
tree node reads its prefix's whole blocks there too, and the rest (the
prefix's partial last block, its ancestors, itself) gathered for it alone
(`tail`, chunks that continue `shared`'s): workers/engine/batch.py.

Shapes: G slots, T new tokens per slot, Hkv key/value heads, rep query heads
per key/value head, R = rep * T queries per slot and key/value head, padded
to `rows`; L keys (a multiple of the chunk), C = L / chunk chunks (Cs shared,
Ct tail), D head size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MIN_ROWS = 4  # rows per product (and a multiple of it): fewer take a differently rounding kernel

Keys = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # keys, values (K, Hkv, L, D); mask


def padded(rows: int) -> int:
    return -(-rows // MIN_ROWS) * MIN_ROWS


def pad_rows(x: torch.Tensor, rows: int, value: float | bool = 0.0) -> torch.Tensor:
    # x: (..., R, X) -> (..., rows, X)
    return F.pad(x, (0, 0, 0, rows - x.shape[-2]), value=value)


def chunks(width: int, chunk: int) -> int:
    """How many chunks `width` keys make; they must make whole ones."""
    if width % chunk:
        raise ValueError(f"key width {width} is not a multiple of the chunk ({chunk})")
    return width // chunk


def chunked(x: torch.Tensor, chunk: int) -> torch.Tensor:
    # x: (K, Hkv, L, D) -> (K, Hkv, L / chunk, chunk, D) float32
    k, h, width, d = x.shape
    return x.float().view(k, h, chunks(width, chunk), chunk, d)


def sum_chunks(*parts: torch.Tensor) -> torch.Tensor:
    # parts: (G, Hkv, C_i, rows, X) each -> (G, Hkv, rows, X): every chunk of the parts, in
    # order, added one after another (as if concatenated, without the copy). Zero chunks
    # anywhere (a batch's wider padding, a tree group's shared columns another slot needs)
    # add nothing: one order whatever the batch looks like.
    first, *rest = [c for part in parts for c in part.unbind(2)]  # one view per chunk
    total = first.clone()
    for x in rest:
        total += x
    return total


def joined_chunks(parts: list[torch.Tensor]) -> torch.Tensor:
    # parts: (G, Hkv or 1, C_i, rows, chunk) each -> (G, Hkv or 1, C, rows, chunk); one part
    # as it is (a decode's shared keys alone: no copy)
    return parts[0] if len(parts) == 1 else torch.cat(parts, 2)


def scores_by_chunk(q: torch.Tensor, keys: torch.Tensor, chunk: int) -> torch.Tensor:
    # q: (K, Hkv, R, D) float32, R a multiple of MIN_ROWS; keys: (K, Hkv, L, D)
    # -> (K, Hkv, L / chunk, R, chunk): one product over all L keys, viewed by chunk
    k, h, r, _ = q.shape
    count = chunks(keys.shape[2], chunk)
    scores = torch.matmul(q, keys.float().transpose(-1, -2))  # (K, Hkv, R, L)
    return scores.view(k, h, r, count, chunk).transpose(2, 3)


def visible(mask: torch.Tensor, rep: int, rows: int, chunk: int) -> torch.Tensor:
    # mask: (G, 1, T, L) -> (G, 1, C, rows, chunk), each query head of a token as the token
    g, _, t, width = mask.shape
    per_query = mask.unsqueeze(2).expand(g, 1, rep, t, width).reshape(g, 1, rep * t, width)
    padded_mask = pad_rows(per_query, rows, value=True)  # (G, 1, rows, L)
    return padded_mask.view(g, 1, rows, width // chunk, chunk).transpose(2, 3)


def tail_to_slots(x: torch.Tensor, g: int, t: int) -> torch.Tensor:
    # x: (G * T, Hkv, Ct, rep, X) -> (G, Hkv, Ct, rep * T, X)
    _, hkv, ct, rep, last = x.shape
    x = x.view(g, t, hkv, ct, rep, last).permute(0, 2, 3, 4, 1, 5)
    return x.reshape(g, hkv, ct, rep * t, last)


def slots_to_tail(x: torch.Tensor, rep: int, t: int) -> torch.Tensor:
    # x: (G, Hkv, Ct, rep * T, X) -> (G * T, Hkv, Ct, rep, X)
    g, hkv, ct, _, last = x.shape
    x = x.reshape(g, hkv, ct, rep, t, last).permute(0, 4, 1, 2, 3, 5)
    return x.reshape(g * t, hkv, ct, rep, last)


def attend(q: torch.Tensor, shared: Keys, tail: Keys | None, chunk: int) -> torch.Tensor:
    # q: (G, Hkv, rep, T, D); shared: keys, values (G, Hkv, Ls, D), mask (G, 1, T, Ls);
    # tail: keys, values (G * T, Hkv, Lt, D), mask (G, 1, T, Lt) -> (G, Hkv, rep, T, D)
    g, hkv, rep, t, d = q.shape
    r, rows = rep * t, padded(rep * t)
    q32 = q.float() * d**-0.5
    keys, values, mask = shared
    q_slots = pad_rows(q32.reshape(g, hkv, r, d), rows)  # (G, Hkv, rows, D)
    scores = [scores_by_chunk(q_slots, keys, chunk)]  # (G, Hkv, Cs, rows, chunk)
    seen = [visible(mask, rep, rows, chunk)]  # (G, 1, Cs, rows, chunk)
    if tail is not None:
        tail_keys, tail_values, tail_mask = tail  # (G * T, Hkv, Lt, D) keys, values
        q_tokens = q32.permute(0, 3, 1, 2, 4).reshape(g * t, hkv, rep, d)  # (G * T, Hkv, rep, D)
        q_tokens = pad_rows(q_tokens, padded(rep))  # (G * T, Hkv, rep', D)
        tail_scores = scores_by_chunk(q_tokens, tail_keys, chunk)[..., :rep, :]
        scores.append(pad_rows(tail_to_slots(tail_scores, g, t), rows))  # (G, Hkv, Ct, rows, chunk)
        seen.append(visible(tail_mask, rep, rows, chunk))
    scores = joined_chunks(scores).masked_fill(~joined_chunks(seen), float("-inf"))
    top = scores.amax(4, keepdim=True).amax(2, keepdim=True)  # (G, Hkv, 1, rows, 1): exact
    p = torch.exp(scores - top)  # (G, Hkv, C, rows, chunk), masked: 0
    # each chunk's probability-weighted values with its probability sum beside them, so one
    # fold adds both, element by element in the order two folds would (half the adds)
    p_sums = p.sum(-1, keepdim=True)  # (G, Hkv, C, rows, 1)
    v = chunked(values, chunk)  # (G, Hkv, Cs, chunk, D)
    cs = v.shape[2]
    weighted = torch.matmul(p[:, :, :cs], v)  # (G, Hkv, Cs, rows, D)
    parts = [torch.cat((weighted, p_sums[:, :, :cs]), -1)]  # (G, Hkv, Cs, rows, D + 1)
    if tail is not None:
        tv = chunked(tail_values, chunk)  # (G * T, Hkv, Ct, chunk, D)
        p_tokens = pad_rows(slots_to_tail(p[:, :, cs:, :r], rep, t), padded(rep))
        tail_weighted = torch.matmul(p_tokens, tv)[..., :rep, :]  # (G * T, Hkv, Ct, rep, D)
        tail_slots = pad_rows(tail_to_slots(tail_weighted, g, t), rows)  # (G, Hkv, Ct, rows, D)
        parts.append(torch.cat((tail_slots, p_sums[:, :, cs:]), -1))
    summed, total = sum_chunks(*parts).split([d, 1], -1)  # (G, Hkv, rows, D), (.., 1)
    out = (summed / total)[:, :, :r]  # (G, Hkv, R, D)
    return out.reshape(g, hkv, rep, t, d).to(q.dtype)
