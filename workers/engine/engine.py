"""An engine: a loaded model, its tokenizer, and a slot KV cache.

`Engine.forward` is the only way tokens reach the model. Each `SlotInput`
describes one slot's uncommitted region as a tree (parents, -1 = child of the
committed prefix) and feeds its last T tokens; positions and the attention
mask are derived from the tree, so prefill (a chain), decode (one token),
tree verification and level-by-level draft expansion are the same call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path

import torch

from workers.engine.kv_cache import SlotKVCache
from workers.engine.llama import ForwardBatch, NativeLlama, RowGroup
from workers.engine.packed import pack_linears
from workers.protocol import WorkerInfo
from workers.settings import EMBEDDED_MODEL
from workers.speculation.tree import depths, tree_mask

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    """How to load and size one model engine."""

    model: str = EMBEDDED_MODEL  # alias, local directory, .gguf file or HF id
    device: str = "cpu"  # torch device; "cuda" where a GPU build of torch is installed
    dtype: str = "float32"  # one of DTYPES
    max_sessions: int = 8  # KV slots, i.e. sessions held at once
    max_seq_len: int = 2048  # context per session (capped at the model's context)
    max_tree_nodes: int = 64  # most speculative tokens past the context, cached while verified
    pack_weights: bool = True  # float32 on CPU: oneDNN-packed linear layers (engine/packed.py)
    cache_dir: Path | None = None  # model cache; None = $SPECSPLIT_MODEL_CACHE or ~/.cache


@dataclass(frozen=True)
class SlotInput:
    """One slot's share of a forward."""

    slot: int
    prefix_len: int  # committed cache entries, all visible to the new tokens
    parents: list[int]  # (U,) the uncommitted region as a tree; -1 = child of the prefix
    tokens: list[int]  # (T,) the region's last T tokens, fed now; the rest is cached
    logits_for: int = 1  # how many trailing tokens need logits


@dataclass
class Engine:
    model: NativeLlama
    tokenizer: object
    cache: SlotKVCache
    model_id: str
    context_length: int  # most committed tokens per session
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @classmethod
    def load(cls, config: EngineConfig) -> Engine:
        from transformers import AutoModelForCausalLM

        from workers.engine.loader import load_tokenizer, resolve_model

        path = resolve_model(config.model, config.cache_dir)
        dtype = DTYPES[config.dtype]
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(config.device).eval()
        return cls.from_hf(hf, load_tokenizer(path), config, model_id=config.model)

    @classmethod
    def from_hf(cls, hf_model, tokenizer, config: EngineConfig, model_id: str) -> Engine:
        model = NativeLlama(hf_model).eval()
        if config.pack_weights:
            pack_linears(model)
        shape = model.shape
        cache = SlotKVCache(
            num_layers=shape.num_layers,
            num_slots=config.max_sessions,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            max_seq_len=min(config.max_seq_len, shape.max_positions) + config.max_tree_nodes,
            dtype=next(hf_model.parameters()).dtype,
            device=config.device,
        )
        context = min(config.max_seq_len, shape.max_positions)
        return cls(model, tokenizer, cache, model_id, context, torch.device(config.device))

    @property
    def vocab_size(self) -> int:
        return self.model.shape.vocab_size

    @property
    def max_tree_nodes(self) -> int:
        """Cache room past the context for a tree under verification."""
        return self.cache.max_seq_len - self.context_length

    @property
    def num_slots(self) -> int:
        return self.cache.num_slots

    def info(self, role: str, max_tree_nodes: int, live_sessions: int) -> WorkerInfo:
        """What a worker over this engine says about itself (its Info call)."""
        from workers.engine.loader import tokenizer_fingerprint

        tokenizer = self.tokenizer
        if tokenizer is None:  # a test model: the vocabulary size is all there is to compare
            fingerprint, eos = f"vocab:{self.vocab_size}", ()
        else:
            fingerprint = tokenizer_fingerprint(tokenizer)
            eos = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
        return WorkerInfo(
            role=role,
            model_id=self.model_id,
            tokenizer_fingerprint=fingerprint,
            vocab_size=self.vocab_size,
            context_length=self.context_length,
            max_sessions=self.num_slots,
            live_sessions=live_sessions,
            eos_token_ids=eos,
            max_tree_nodes=max_tree_nodes,
        )

    @torch.inference_mode()
    def forward(self, rows: list[SlotInput]) -> list[torch.Tensor]:
        """Runs one forward over several slots; returns logits (logits_for_b, V) per row."""
        batch = self.batch(rows)
        hidden = self.model.hidden(self.cache, batch)  # (N, E)
        picked = torch.cat(
            [hidden[end - r.logits_for : end] for end, r in zip(batch.ends, rows, strict=True)]
        )  # (sum logits_for, E)
        logits = self.model.logits(picked)  # (sum logits_for, V)
        return list(logits.split([r.logits_for for r in rows]))

    def batch(self, rows: list[SlotInput]) -> ForwardBatch:
        widths = [r.prefix_len + len(r.parents) for r in rows]  # L_b
        if max(widths) > (room := self.cache.max_seq_len):
            raise ValueError(f"sequence of {max(widths)} tokens exceeds the cache ({room} tokens)")
        lengths = [len(r.tokens) for r in rows]  # T_b
        starts = [0, *accumulate(lengths)]  # row b's tokens: starts[b] to starts[b + 1]
        positions, masks = [], []
        for r in rows:
            n, u = len(r.tokens), len(r.parents)
            parents = torch.tensor(r.parents, dtype=torch.long)  # (U,)
            positions.append(r.prefix_len + depths(parents)[u - n :] - 1)  # (T_b,)
            mask = torch.ones(n, r.prefix_len + u, dtype=torch.bool)  # (T_b, L_b)
            mask[:, r.prefix_len :] = tree_mask(parents)[u - n :]
            masks.append(mask)
        groups = []
        for new in sorted(set(lengths)):
            members = [b for b, n in enumerate(lengths) if n == new]
            width = max(widths[b] for b in members)
            mask = torch.zeros(len(members), 1, new, width, dtype=torch.bool)  # (G, 1, T, L)
            for i, b in enumerate(members):
                mask[i, 0, :, : widths[b]] = masks[b]
            tokens = None
            if len(members) < len(rows):
                tokens = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in members])
            groups.append(
                RowGroup(
                    tokens=None if tokens is None else tokens.to(self.device),
                    slots=torch.tensor([rows[b].slot for b in members], device=self.device),
                    new=new,
                    width=width,
                    mask=mask.to(self.device),
                )
            )
        columns = [torch.arange(w - n, w) for w, n in zip(widths, lengths, strict=True)]
        return ForwardBatch(
            tokens=torch.tensor([x for r in rows for x in r.tokens], device=self.device),
            positions=torch.cat(positions).to(self.device),
            token_slots=torch.tensor(
                [r.slot for r, n in zip(rows, lengths, strict=True) for _ in range(n)],
                device=self.device,
            ),
            token_columns=torch.cat(columns).to(self.device),
            groups=groups,
            ends=starts[1:],
        )

    def commit(self, slot: int, prefix_len: int, keep: list[int]) -> None:
        """Keeps uncommitted entries `keep` (region offsets, increasing) after the prefix."""
        self.cache.commit(slot, prefix_len, keep)
