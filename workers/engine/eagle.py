"""An EAGLE-style feature draft: one decoder layer that predicts the target's next hidden state.

The head reads the target's own features instead of tokens alone (EAGLE, Li et
al. 2024). Fed the target's final hidden state f_t (the last layer's output,
before the final norm) and the embedding of token t + 1, it predicts f_{t+1}:

    x      = fuse(concat[f_t, embed(token_{t+1})])      E * 2 -> E
    f'_t+1 = decoder_layer(x)                            one Llama layer, own KV cache
    logits = lm_head(final_norm(f'_t+1))                 the target's norm and LM head

so its guess of token t + 2 is read out exactly as the target reads its own
state, over the target ids the head keeps (all of them, or the K its data used
most: the LM head's other rows are never read, and those ids get logit -inf, so
the head never proposes them and its q rows stay exact). Expanding a tree,
level k feeds each node with the feature the head predicted for its parent at
level k - 1 (EAGLE-1/2), one forward per level.

A head directory is a one-layer Llama in HF layout (config.json shaped like
the target's but with num_hidden_layers 1, model.safetensors holding the
layer and copies of the target's embedding, final norm and LM head, the
target's tokenizer files) plus `eagle_fuse.safetensors` (the fuse weight),
optionally `eagle_vocab.safetensors` (the kept target ids) and
`specsplit_draft.json` saying {"kind": "eagle"}. A directory without that file
is a plain model draft. Either loads with `--model` / `--draft-model`.

Shapes: N tokens, E the target's hidden size, V the target's vocabulary, K kept ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from workers.engine.batch import ForwardBatch
from workers.engine.llama import NativeLlama
from workers.engine.paged_attention import CompiledAttention

DRAFT_FILE = "specsplit_draft.json"  # {"kind": "model" | "eagle"}; absent = "model"
FUSE_FILE = "eagle_fuse.safetensors"  # {"weight": (E, 2E)}
VOCAB_FILE = "eagle_vocab.safetensors"  # {"ids": (K,) ascending target ids}; absent = all V
KINDS = ("model", "eagle")


def draft_kind(path: Path) -> str:
    """Which kind of draft a model directory holds: "model" (a small LM) or "eagle"."""
    marker = Path(path) / DRAFT_FILE
    if not marker.is_file():
        return "model"
    kind = json.loads(marker.read_text()).get("kind", "model")
    if kind not in KINDS:
        raise ValueError(f"{marker}: draft kind {kind!r} is not one of {', '.join(KINDS)}")
    return kind


def load_fuse(path: Path, dtype: torch.dtype, device: str) -> nn.Linear:
    """The head's E * 2 -> E input projection, from its directory."""
    weight = load_file(Path(path) / FUSE_FILE)["weight"]  # (E, 2E)
    fuse = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    fuse.weight = nn.Parameter(weight.to(device, dtype), requires_grad=False)
    return fuse


def load_vocab(path: Path) -> torch.Tensor | None:
    """(K,) the target ids a head's LM head keeps, from its directory; None = all."""
    file = Path(path) / VOCAB_FILE
    return load_file(file)["ids"] if file.is_file() else None


class EagleHead(NativeLlama):
    """The native forward of a one-layer head whose input fuses target states and tokens.
    With `kept` (K,) target ids its LM head holds only their rows (module docstring)."""

    takes_features = True
    input_linears = ("fuse",)

    def __init__(
        self,
        hf_model,
        fuse: nn.Linear,
        compiled: CompiledAttention | None = None,
        kept: torch.Tensor | None = None,
    ):
        super().__init__(hf_model, compiled)
        if self.shape.num_layers != 1 or fuse.in_features != 2 * self.shape.hidden_size:
            raise ValueError(
                f"an EAGLE head has one layer and a {2 * self.shape.hidden_size} -> "
                f"{self.shape.hidden_size} fuse; got {self.shape.num_layers} layers and "
                f"{fuse.in_features} -> {fuse.out_features}"
            )
        self.fuse = fuse
        if kept is not None:
            weight = self.lm_head.weight.detach()  # (V, E)
            if kept.ndim != 1 or not 0 < len(kept) <= len(weight) or int(kept.max()) >= len(weight):
                raise ValueError(f"kept ids must be 1 to {len(weight)} ids below {len(weight)}")
            self.kept = kept.to(weight.device, torch.long)  # (K,)
            self.lm_head = nn.Linear(weight.shape[1], len(kept), bias=False, device="meta")
            self.lm_head.weight = nn.Parameter(weight[self.kept].clone(), requires_grad=False)

    def inputs(self, batch: ForwardBatch, features: torch.Tensor | None) -> torch.Tensor:
        # features: (N, E), the state paired with each new token -> (N, E)
        if features is None or features.shape != (len(batch.tokens), self.shape.hidden_size):
            raise ValueError("an EAGLE head needs one (E,) feature per new token")
        return self.fuse(torch.cat([features, self.embed(batch.tokens)], dim=-1))


def init_eagle_head(target_hf, seed: int = 0) -> tuple[nn.Module, nn.Linear]:
    """A random head for `target_hf` (a transformers Llama-family model): one fresh layer
    shaped like the target's, the target's embedding, final norm and LM head copied in."""
    from transformers import AutoModelForCausalLM

    config = target_hf.config.__class__.from_dict(
        {**target_hf.config.to_dict(), "num_hidden_layers": 1}
    )
    torch.manual_seed(seed)
    head = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    e = config.hidden_size
    with torch.no_grad():
        head.model.embed_tokens.weight.copy_(target_hf.model.embed_tokens.weight)
        head.model.norm.weight.copy_(target_hf.model.norm.weight)
        if not config.tie_word_embeddings:
            head.lm_head.weight.copy_(target_hf.lm_head.weight)
        fuse = nn.Linear(2 * e, e, bias=False)
    return head, fuse.requires_grad_(False)


def save_eagle_head(
    out: Path, head, fuse: nn.Linear, tokenizer=None, kept: torch.Tensor | None = None
) -> Path:
    """Writes a head directory (see the module docstring) that `Engine.load` serves;
    `kept` (K,) ascending target ids its LM head keeps (None: all)."""
    out = Path(out)
    head.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    save_file({"weight": fuse.weight.detach().contiguous()}, out / FUSE_FILE)
    (out / VOCAB_FILE).unlink(missing_ok=True)
    if kept is not None:
        save_file({"ids": kept.to(torch.long).contiguous()}, out / VOCAB_FILE)
    (out / DRAFT_FILE).write_text(json.dumps({"kind": "eagle"}) + "\n")
    return out
