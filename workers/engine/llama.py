"""A native forward pass for the Llama family over a block-paged KV cache.

Llama 2/3, Qwen2/2.5, Mistral and SmolLM share one block: RMSNorm, rotary
position embeddings (with any scaling variant transformers knows), grouped-query
attention, a SwiGLU MLP, optionally tied embeddings and q/k/v biases. The
weights are the ones of the transformers model (its `nn.Linear` modules are
reused as they are); the forward is ours, so that one call can take new tokens
for several sessions, each at its own positions, behind its own committed
prefix, and under its own tree attention mask.

Shapes: B slots in a batch, T new tokens per slot (padded), L keys visible
(committed prefix + uncommitted region), H query heads, Hkv key/value heads,
D head size, E hidden size, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from workers.engine.attention import attend
from workers.engine.batch import ForwardBatch, RowGroup
from workers.engine.kv_cache import PagedKVCache
from workers.engine.paged_attention import CompiledAttention

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")


class UnsupportedArchitectureError(ValueError):
    """The model is outside the Llama family this engine implements natively."""


@dataclass(frozen=True)
class LlamaShape:
    """The numbers of a Llama-family model that the forward pass needs."""

    vocab_size: int  # V
    hidden_size: int  # E
    num_layers: int
    num_heads: int  # H
    num_kv_heads: int  # Hkv
    head_dim: int  # D
    rms_norm_eps: float
    max_positions: int  # the model's context length

    @classmethod
    def from_config(cls, config) -> LlamaShape:
        if config.model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"architecture {config.model_type!r} is not in the native Llama family "
                f"({', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_positions=config.max_position_embeddings,
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: (..., E) -> (..., E), computed in float32 as the reference does
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    # x: (..., D) -> (..., D): (x1, x2) -> (-x2, x1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """cos/sin tables for explicit positions, with transformers' RoPE variants."""

    def __init__(self, config):
        super().__init__()
        rope = getattr(config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type == "default":
            shape = LlamaShape.from_config(config)
            theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            steps = torch.arange(0, shape.head_dim, 2, dtype=torch.float) / shape.head_dim
            inv_freq, scaling = 1.0 / (theta**steps), 1.0
        else:
            init: Callable = ROPE_INIT_FUNCTIONS[rope_type]
            inv_freq, scaling = init(config)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)  # (D/2,)
        self.scaling = float(scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        # positions: (N,) -> cos, sin: (N, 1, D)
        freqs = positions[..., None].float() * self.inv_freq  # (N, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (N, D)
        cos = (emb.cos() * self.scaling).to(dtype)[:, None]
        sin = (emb.sin() * self.scaling).to(dtype)[:, None]
        return cos, sin


def fuse(*linears: nn.Linear) -> nn.Linear:
    """One linear layer computing several that read the same input: outputs side by side.

    A decode step feeds a few rows, where each matrix product's fixed cost
    (dispatch, packing, threads) outweighs its arithmetic: one product for
    q/k/v (and one for gate/up) instead of three (two) saves that cost.
    """
    weight = torch.cat([lin.weight.detach() for lin in linears])  # (sum out, in)
    biased = any(lin.bias is not None for lin in linears)
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=biased, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if biased:
        biases = [
            lin.bias.detach() if lin.bias is not None else weight.new_zeros(lin.out_features)
            for lin in linears
        ]
        fused.bias = nn.Parameter(torch.cat(biases), requires_grad=False)  # (sum out,)
    return fused


class Block(nn.Module):
    """One decoder layer over the weights of a transformers decoder layer."""

    def __init__(self, hf_layer, shape: LlamaShape, index: int, compiled: CompiledAttention | None):
        super().__init__()
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.qkv_proj = fuse(attn.q_proj, attn.k_proj, attn.v_proj)  # E -> (H + 2 Hkv) D
        self.o_proj = attn.o_proj
        self.gate_up_proj = fuse(mlp.gate_proj, mlp.up_proj)  # E -> 2F (F: MLP width)
        self.down_proj = mlp.down_proj
        self.norm_attn = hf_layer.input_layernorm.weight
        self.norm_mlp = hf_layer.post_attention_layernorm.weight
        self.shape = shape
        self.index = index
        self.compiled = compiled  # None: attention.py's chunked attention

    def project_qkv(self, x: torch.Tensor):
        # x: (N, E) -> q: (N, H, D), k, v: (N, Hkv, D)
        s = self.shape
        n, q_width, kv_width = x.shape[0], s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        q, k, v = self.qkv_proj(x).split([q_width, kv_width, kv_width], dim=-1)
        return (
            q.view(n, s.num_heads, s.head_dim),
            k.view(n, s.num_kv_heads, s.head_dim),
            v.view(n, s.num_kv_heads, s.head_dim),
        )

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        # h: (N, E) -> (N, E): SwiGLU, down(silu(gate(h)) * up(h))
        gate_up = self.gate_up_proj(h)  # (N, 2F)
        if self.compiled is not None:
            return self.down_proj(self.compiled.swiglu(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)  # (N, F) each
        return self.down_proj(F.silu(gate) * up)

    def attention(self, x, cos, sin, cache: PagedKVCache, batch: ForwardBatch):
        # x: (N, E) -> (N, E); cos, sin: (N, 1, D)
        if self.compiled is not None:  # rotary, the cache write and attention in one call
            k_pool, v_pool = cache.k[self.index], cache.v[self.index]
            return self.o_proj(self.compiled(self.qkv_proj(x), cos, sin, k_pool, v_pool, batch))
        s = self.shape
        n = x.shape[0]
        q, k, v = self.project_qkv(x)  # (N, H, D), (N, Hkv, D), (N, Hkv, D)
        q = q * cos + rotate_half(q) * sin
        cache.write(self.index, batch, k * cos + rotate_half(k) * sin, v)
        if len(batch.groups) == 1:  # every row feeds as many tokens: attend to all at once
            out = self.attend(q, cache, batch.groups[0])  # (N, H, D)
        else:
            out = torch.empty_like(q)  # (N, H, D)
            for g in batch.groups:
                out[g.tokens] = self.attend(q[g.tokens], cache, g)
        return self.o_proj(out.reshape(n, s.num_heads * s.head_dim))

    def attend(self, q: torch.Tensor, cache: PagedKVCache, g: RowGroup) -> torch.Tensor:
        # q: (G * T, H, D), the group's queries row after row -> (G * T, H, D)
        s = self.shape
        rep = s.num_heads // s.num_kv_heads  # query head h reads key/value head h // rep
        shared = (*cache.read(self.index, g.shared), g.shared.mask)  # (G, Hkv, Ls, D) keys, values
        tail = None if g.tail is None else (*cache.read(self.index, g.tail), g.tail.mask)
        q = q.view(-1, g.new, s.num_kv_heads, rep, s.head_dim)  # (G, T, Hkv, rep, D)
        q = q.permute(0, 2, 3, 1, 4)  # (G, Hkv, rep, T, D)
        out = attend(q, shared, tail, cache.block_size)  # (G, Hkv, rep, T, D)
        return out.permute(0, 3, 1, 2, 4).reshape(-1, s.num_heads, s.head_dim)

    def add_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x, delta: (N, E) -> x + delta (x where delta is None) and its RMS norm, (N, E) each
        eps = self.shape.rms_norm_eps
        if self.compiled is None:
            x = x if delta is None else x + delta
            return x, rms_norm(x, weight, eps)
        if delta is None:
            return x, self.compiled.rms_norm(x, weight, eps)
        return self.compiled.add_rms_norm(x, delta, weight, eps)

    def forward(self, x, delta, cos, sin, cache: PagedKVCache, batch: ForwardBatch):
        # x: (N, E) the residual stream; delta: (N, E) the last block's MLP output, still to
        # add, or None -> the same two for the next block: each residual add goes with the
        # norm after it (one pass over the rows where the attention is compiled)
        x, h = self.add_norm(x, delta, self.norm_attn)
        x, h = self.add_norm(x, self.attention(h, cos, sin, cache, batch), self.norm_mlp)
        return x, self.mlp(h)


class NativeLlama(nn.Module):
    """The Llama-family forward over a `PagedKVCache`, sharing the weights of `hf_model`;
    attention by `compiled` (workers/engine/paged_attention.py), or where None by the
    chunked torch ops of workers/engine/attention.py."""

    def __init__(self, hf_model, compiled: CompiledAttention | None = None):
        super().__init__()
        config = hf_model.config
        self.shape = LlamaShape.from_config(config)
        if getattr(config, "use_sliding_window", False) and config.sliding_window:
            raise UnsupportedArchitectureError(
                "sliding-window attention is not implemented natively; "
                "serve this model with a context no longer than its window"
            )
        body = hf_model.model
        self.embed = body.embed_tokens
        self.blocks = nn.ModuleList(
            Block(layer, self.shape, i, compiled) for i, layer in enumerate(body.layers)
        )
        self.norm = body.norm.weight
        self.lm_head = hf_model.lm_head
        self.rotary = Rotary(config).to(self.embed.weight.device)
        self.compiled = compiled  # its batches list each token's keys when set
        # all blocks in one call (paged_attention.CompiledBlocks), set by the engine where the
        # model is bfloat16 with packed weights and the compiled attention
        self.compiled_blocks: Callable | None = None

    takes_features = False  # whether its input pairs each token with a target hidden state
    input_linears: tuple[str, ...] = ()  # linear layers of its input, packed like the blocks'
    kept: torch.Tensor | None = None  # (K,) the ids its LM head's rows read out; None = all V

    @property
    def prompt_token_share(self) -> float:
        """What a token fed for its keys and values alone (a prompt's) costs against one fed
        for its logits as well: the blocks' matrix weights over the blocks' and the LM
        head's (a weight is one multiply-add per token; attention over the context left
        out). Linear and packed layers both state their in and out features."""

        def weights(module: nn.Module) -> int:
            layers = [m for m in module.modules() if hasattr(m, "out_features")]
            return sum(m.in_features * m.out_features for m in layers)

        blocks = weights(self.blocks)
        return blocks / (blocks + weights(self.lm_head))

    def inputs(self, batch: ForwardBatch, features: torch.Tensor | None) -> torch.Tensor:
        """The first layer's input (N, E): the new tokens' embeddings."""
        if features is not None:
            raise ValueError(f"{type(self).__name__} takes no features")
        return self.embed(batch.tokens)

    def hidden(
        self, cache: PagedKVCache, batch: ForwardBatch, features: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Writes the new tokens' keys/values into the cache; returns the last layer's
        output (N, E), before the final norm. `features` (N, E): see `inputs`."""
        x, delta = self.inputs(batch, features), None  # (N, E); see Block.forward
        cos, sin = self.rotary(batch.positions, x.dtype)  # (N, 1, D) each
        if self.compiled_blocks is not None:
            return self.compiled_blocks(x, cos, sin, cache, batch)
        for block in self.blocks:
            x, delta = block(x, delta, cos, sin, cache, batch)
        return x if delta is None else x + delta

    def readout(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: (..., E), before the final norm -> (..., K) float32, one per `kept` id
        return self.lm_head(rms_norm(hidden, self.norm, self.shape.rms_norm_eps)).float()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: (..., E), before the final norm -> (..., V) float32, -inf off the kept ids
        small = self.readout(hidden)  # (..., K)
        if self.kept is None:
            return small
        full = small.new_full((*small.shape[:-1], self.shape.vocab_size), float("-inf"))
        full[..., self.kept] = small
        return full
