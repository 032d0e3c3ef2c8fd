"""The draft model: a small Llama over the target's tokenizer, trained on a kept vocabulary.

Shape. `draft_config` makes a narrow Llama (hidden H, L layers) with the target's attention
heads (count and size), MLP width, vocabulary size V, RoPE, context and special token ids,
and tied embeddings.

Kept vocabulary, exactly. Of the V target ids the draft gives its own row to K of them,
the tokens the data actually uses (`choose_vocab`). The saved model is a plain tied
LlamaForCausalLM over all V ids whose embedding rows outside the kept set are zero. A zero
row means:
  - as an output row: the token's logit is exactly 0 for every input, so the saved model's
    softmax is q(t) = exp(l_t) / (sum_kept exp(l_j) + (V - K)) over all V target ids, a
    proper distribution that needs no id mapping at all (row t is target id t);
  - as an input row: an unkept token in the history (a rare word in a prompt) reaches the
    draft as a zero vector, a blank position. Only the draft's guesses suffer; the
    target verifies every guess, so output stays lossless whatever the draft proposes.
`DraftTrainer` computes that same distribution from the K kept rows alone, with the V - K
zero logits folded into the normaliser analytically: training optimises exactly the
function the saved directory computes, at the cost of a K-row head instead of a V-row one.
A trained draft puts almost all its mass on kept tokens (the target does), so its kept
logits sit far above 0 and an unkept token is practically never its argmax; the final
report counts how often it is.

Initialisation. The draft starts as the target's first L layers seen through an H-dim
window: the H principal axes of the target's residual stream over those layers (which
hold nearly all its energy). Embeddings, attention and MLP weights are the target's,
projected on the axes, with the target's RMSNorm gains folded into the weights that read
them; so training starts from the target's own features, not from noise.
"""

from __future__ import annotations

import copy
import math
import shutil
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel, PretrainedConfig

from workers.tools.distill.data import Example

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def draft_config(target: PretrainedConfig, layers: int, hidden: int, intermediate: int):
    """A narrow tied Llama with the target's heads, vocabulary, positions and special tokens."""
    heads, width = target.num_attention_heads, target.hidden_size
    if hidden % heads or not 0 < hidden <= width:
        raise ValueError(f"--hidden must be a multiple of {heads} (the target's heads), <= {width}")
    if not 0 < layers <= target.num_hidden_layers:
        raise ValueError(f"--layers must be 1 to {target.num_hidden_layers}")
    rope = getattr(target, "rope_parameters", None) or {
        "rope_type": "default",
        "rope_theta": getattr(target, "rope_theta", 10000.0),
    }
    return LlamaConfig(
        vocab_size=target.vocab_size,
        hidden_size=hidden,
        intermediate_size=min(intermediate or target.intermediate_size, target.intermediate_size),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=target.num_key_value_heads,
        head_dim=getattr(target, "head_dim", None) or width // heads,
        max_position_embeddings=target.max_position_embeddings,
        rms_norm_eps=target.rms_norm_eps,
        rope_parameters=dict(rope),
        tie_word_embeddings=True,
        bos_token_id=target.bos_token_id,
        eos_token_id=target.eos_token_id,
        pad_token_id=getattr(target, "pad_token_id", None),
    )


def choose_vocab(examples: list[Example], vocab_size: int, top: int, always: list[int]):
    """(K,) ascending target ids: those the data uses most, at most `top` (0 = all V).

    A token scores the target's probability mass on it over all positions plus its count
    in the inputs (as input it needs an embedding). `always` (special tokens) is kept.
    """
    if top <= 0 or top >= vocab_size:
        return torch.arange(vocab_size)
    score: Counter[int] = Counter()
    for e in examples:
        score.update(e.ids)
        mass = e.top_logp.exp()  # (N-1, k)
        flat = torch.zeros(vocab_size).index_add_(0, e.top_ids.flatten(), mass.flatten())
        nonzero = flat.nonzero().flatten()
        score.update(dict(zip(nonzero.tolist(), flat[nonzero].tolist(), strict=True)))
    for token in always:
        score[token] = math.inf
    ranked = sorted(score.items(), key=lambda item: (-item[1], item[0]))[:top]
    return torch.tensor(sorted(t for t, _ in ranked))


@torch.no_grad()
def residual_axes(target_hf, layers: int, hidden: int, sequences: list[list[int]]):
    """(E, H): the top principal axes of the target's residual stream over its first layers."""
    width = target_hf.config.hidden_size
    moment = torch.zeros(width, width)  # (E, E), uncentred: the mean direction matters too
    for ids in sequences:
        out = target_hf.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        for x in out.hidden_states[: layers + 1]:  # embeddings, then after each layer
            x = x[0, 1:].float()  # (N-1, E); position 0 is an attention sink, outsized
            moment += x.T @ x
    return torch.linalg.eigh(moment).eigenvectors[:, -hidden:].flip(-1)  # largest first


@torch.no_grad()
def init_from_target(trainer: DraftTrainer, target_hf, axes: torch.Tensor) -> None:
    """The draft as the target's first L layers in the window `axes` (E, H).

    A residual vector x (E) is carried as x' = axes.T x (H), so x ~ axes x'. The same vector
    has rms_E(x) = |x| / sqrt(E) and rms_H(x') = |x'| / sqrt(H), so a target layer reading
    W (g * x / rms_E(x)) reads (W diag(g) axes) sqrt(E / H) (x' / rms_H(x')): the gain g
    and the factor fold into the draft's weights (`read`), whose own gains start at 1.
    Layers that write to the residual (o_proj, down_proj) write through axes.T.
    """
    width, hidden = axes.shape
    scale = math.sqrt(width / hidden)

    def read(linear, gain):  # (out, E) -> (out, H)
        return (linear.weight.float() * gain.float()) @ axes * scale

    trainer.table.copy_(target_hf.get_input_embeddings().weight.float()[trainer.kept] @ axes)
    for src, dst in zip(target_hf.model.layers, trainer.body.layers, strict=False):
        g_attn, g_mlp = src.input_layernorm.weight, src.post_attention_layernorm.weight
        attn, mlp = src.self_attn, src.mlp
        dst.self_attn.q_proj.weight.copy_(read(attn.q_proj, g_attn))
        dst.self_attn.k_proj.weight.copy_(read(attn.k_proj, g_attn))
        dst.self_attn.v_proj.weight.copy_(read(attn.v_proj, g_attn))
        dst.self_attn.o_proj.weight.copy_(axes.T @ attn.o_proj.weight.float())
        # the strongest neurons when the draft's MLP is narrower than the target's
        strength = (
            mlp.gate_proj.weight.norm(dim=1)
            * mlp.up_proj.weight.norm(dim=1)
            * mlp.down_proj.weight.norm(dim=0)
        )
        keep = strength.topk(dst.mlp.gate_proj.weight.shape[0]).indices.sort().values
        dst.mlp.gate_proj.weight.copy_(read(mlp.gate_proj, g_mlp)[keep])
        dst.mlp.up_proj.weight.copy_(read(mlp.up_proj, g_mlp)[keep])
        dst.mlp.down_proj.weight.copy_(axes.T @ mlp.down_proj.weight.float()[:, keep])
        dst.input_layernorm.weight.fill_(1.0)
        dst.post_attention_layernorm.weight.fill_(1.0)
    # the final gain does not commute with the window; its diagonal there is the nearest fit
    final = target_hf.model.norm.weight.float()
    trainer.body.norm.weight.copy_(torch.einsum("eh,e,eh->h", axes, final, axes) * scale)


class DraftTrainer(nn.Module):
    """The draft while it trains: a Llama body and one table of kept-token rows, used to
    embed inputs and to score outputs (tied), never materialising the V - K zero rows."""

    def __init__(self, config: LlamaConfig, kept: torch.Tensor):
        super().__init__()
        vocab, hidden, k = config.vocab_size, config.hidden_size, len(kept)
        body_config = copy.deepcopy(config)
        body_config.vocab_size, body_config.pad_token_id = 1, None  # inputs come as vectors
        self.config = config
        self.body = LlamaModel(body_config)
        self.table = nn.Parameter(torch.zeros(k, hidden))  # (K, H): row j is target id kept[j]
        slot_of = torch.full((vocab,), k, dtype=torch.long)
        slot_of[kept] = torch.arange(k)
        self.register_buffer("kept", kept.clone())  # (K,) target ids, ascending
        self.register_buffer("slot_of", slot_of)  # (V,) table row of each target id; K = unkept
        self.log_unkept = math.log(vocab - k) if vocab > k else -math.inf  # log(V - K)

    def forward(self, slots: torch.Tensor, mask: torch.Tensor, at: torch.Tensor | None = None):
        """log q over [kept tokens..., any one unkept token] for input slots (B, T).

        Returns (B, T, K+1), or (P, K+1) for the P positions where `at` (B, T) is True.
        """
        rows = torch.cat([self.table, self.table.new_zeros(1, self.table.shape[1])])  # (K+1, H)
        x = F.embedding(slots, rows)  # (B, T, H); unkept inputs are zero vectors
        h = self.body(inputs_embeds=x, attention_mask=mask).last_hidden_state  # (B, T, H)
        if at is not None:
            h = h[at]  # (P, H): score only the positions the loss uses
        logits = h @ rows.T  # (..., K+1); the last column is the 0 logit of an unkept token
        log_z = torch.logaddexp(logits[..., :-1].logsumexp(-1), torch.tensor(self.log_unkept))
        return logits - log_z[..., None]  # normalised over all V target ids

    def full_embedding(self) -> torch.Tensor:
        """(V, H): the saved tied matrix, kept rows in place and zeros elsewhere."""
        weight = self.table.new_zeros(self.config.vocab_size, self.table.shape[1])
        weight[self.kept] = self.table.detach()
        return weight


def export(trainer: DraftTrainer, out: Path, tokenizer_dir: Path, dtype: torch.dtype) -> None:
    """Writes `out` as a plain HF model directory: config, safetensors, the target's tokenizer."""
    model = LlamaForCausalLM(trainer.config)
    body = {k: v for k, v in trainer.body.state_dict().items() if not k.startswith("embed_")}
    result = model.model.load_state_dict(body, strict=False)
    if result.unexpected_keys or set(result.missing_keys) != {"embed_tokens.weight"}:
        raise RuntimeError(f"draft body does not match its config: {result}")
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(trainer.full_embedding())
    model.tie_weights()
    model.to(dtype).eval().save_pretrained(out)
    for name in TOKENIZER_FILES:  # copied as they are: the tokenizer fingerprints must match
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, out / name)
