"""An engine: a loaded model, its tokenizer, and a block-paged KV cache.

`Engine.forward` is the only way tokens reach the model: it takes one
`SlotInput` per slot (workers/engine/batch.py), so prefill (a chain), decode
(one token), tree verification and level-by-level draft expansion are the
same call. A runner reserves each row's KV blocks first
(`SessionTable.reserve`, which evicts idle sessions when the pool is short).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path

import torch

from workers.engine.batch import SlotInput, build_batch
from workers.engine.bf16_linear import AMX_ROWS, KERNEL_ROWS, Bf16Linear, bf16_kernel
from workers.engine.cuda_graphs import CudaGraphs
from workers.engine.eagle import EagleHead, draft_kind, load_fuse, load_vocab
from workers.engine.kv_cache import PagedKVCache
from workers.engine.llama import LlamaShape, NativeLlama
from workers.engine.packed import pack_linears
from workers.engine.paged_attention import CompiledBlocks, compiled_attention
from workers.protocol import WorkerInfo
from workers.settings import EMBEDDED_MODEL, Attention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

log = logging.getLogger(__name__)


def resolve_dtype(name: str, device: str, kernels: Path) -> str:
    """A dtype of DTYPES for `name`, which may be "auto": bfloat16 on a GPU that has it, and
    on a CPU where the compiled bfloat16 kernel builds (workers/engine/bf16_linear.py; 2.5x
    float32's tokens/s at one stream on the machine of bench/RESULTS.md); else float32.
    `kernels`: where compiled kernels are cached."""
    if name != "auto":
        return name
    where = torch.device(device)
    if where.type == "cuda":
        chosen = "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    elif where.type == "cpu":
        kernel = bf16_kernel(torch.bfloat16, where, kernels)
        chosen = "float32" if kernel is None else "bfloat16"
    else:
        chosen = "float32"
    log.info("dtype auto: %s on %s", chosen, where.type)
    return chosen


@dataclass(frozen=True)
class EngineConfig:
    """How to load and size one model engine."""

    model: str = EMBEDDED_MODEL  # alias, local directory, .gguf file or HF id
    device: str = "cpu"  # torch device; "cuda" where a GPU build of torch is installed
    dtype: str = "float32"  # one of DTYPES, or "auto" (resolve_dtype)
    max_sessions: int = 8  # sessions held at once (each a block table, no memory of its own)
    max_seq_len: int = 2048  # context per session (capped at the model's context)
    max_tree_nodes: int = 64  # most speculative tokens past the context, cached while verified
    # KV cache positions shared by all sessions; None = every session at its full context
    kv_tokens: int | None = None
    kv_block_size: int = 16  # positions per KV block (the unit sessions take and return)
    # on the CPU, float32: oneDNN-packed linear layers (engine/packed.py); they also round a
    # row the same whatever rows share the product, which plain (MKL) float32 layers do not;
    # bfloat16: the compiled kernel's packed panels (engine/bf16_linear.py)
    pack_weights: bool = True
    # "compiled" (workers/engine/paged_attention.py), "chunked" (workers/engine/attention.py),
    # or "auto": compiled where it can serve (a CPU, float32 or bfloat16, a C compiler)
    attention: Attention = "auto"
    # threads of the compiled bfloat16 kernel, shared with the compiled attention beside it;
    # 0 = torch's (torch.get_num_threads())
    kernel_threads: int = 0
    # the bfloat16 kernel on the CPU's AMX tile unit where it has one (engine/bf16_linear.py)
    amx: bool = True
    # a bfloat16 model's blocks in one C call (paged_attention.CompiledBlocks) where the kernel
    # and the compiled attention serve it; False: op by op from Python, the same bits
    compiled_blocks: bool = True
    # on a CUDA device, decode and verify forwards captured as CUDA graphs and replayed
    # (workers/engine/cuda_graphs.py); False: every forward launched op by op
    cuda_graphs: bool = True
    # share full KV blocks between sessions by their tokens (workers/engine/prefix_cache.py);
    # never for an EAGLE head, whose keys and values also depend on the states it is fed
    prefix_caching: bool = True
    cache_dir: Path | None = None  # model cache; None = $SPECSPLIT_MODEL_CACHE or ~/.cache


@dataclass(frozen=True)
class Forward:
    """What one forward gives each row."""

    # (logits_for_b, V) float32 per row: its trailing tokens' (K wide, one per model.kept id,
    # where the forward ran with `kept`)
    logits: list[torch.Tensor]
    hidden: list[torch.Tensor]  # (T_b, E) per row: each fed token's state before the final norm


@dataclass
class Engine:
    model: NativeLlama
    tokenizer: object
    cache: PagedKVCache
    model_id: str
    context_length: int  # most committed tokens per session
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    graphs: CudaGraphs | None = None  # captured forwards, on a CUDA device

    @classmethod
    def load(cls, config: EngineConfig) -> Engine:
        from transformers import AutoModelForCausalLM

        from workers.engine.loader import default_cache_dir, load_tokenizer, resolve_model

        path = resolve_model(config.model, config.cache_dir)
        kernels = config.cache_dir or default_cache_dir()  # where compiled kernels are cached
        dtype = DTYPES[resolve_dtype(config.dtype, config.device, kernels)]
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(config.device).eval()
        fuse = kept = None
        if draft_kind(path) == "eagle":
            fuse, kept = load_fuse(path, dtype, config.device), load_vocab(path)
        tokenizer = load_tokenizer(path)
        return cls.from_hf(hf, tokenizer, config, model_id=config.model, fuse=fuse, kept=kept)

    @classmethod
    def from_hf(
        cls, hf_model, tokenizer, config: EngineConfig, model_id: str, fuse=None, kept=None
    ) -> Engine:
        """An engine over a transformers model; with `fuse` (an EAGLE head's E*2 -> E linear,
        workers/engine/eagle.py) the model is that head's one layer, fed target states,
        reading out the target ids `kept` ((K,), None = all)."""
        from workers.engine.loader import default_cache_dir

        shape = LlamaShape.from_config(hf_model.config)
        dtype = next(hf_model.parameters()).dtype
        kernels = config.cache_dir or default_cache_dir()  # where compiled kernels are cached
        device = torch.device(config.device)
        threads = config.kernel_threads or torch.get_num_threads()
        kernel = (
            bf16_kernel(dtype, device, kernels, threads, config.amx)
            if config.pack_weights
            else None
        )
        pool = None if kernel is None else kernel.pool  # the attention shares its threads
        if kernel is not None:
            how = "AMX tiles" if kernel.amx else "vector instructions"
            log.info("bfloat16 kernel: %s on %d threads", how, kernel.threads)
        compiled = compiled_attention(
            config.attention, device, dtype, shape.head_dim, kernels, pool
        )
        if fuse is None:
            model = NativeLlama(hf_model, compiled).eval()
        else:
            model = EagleHead(hf_model, fuse, compiled, kept).eval()
        if config.pack_weights:
            pack_linears(model, kernel)
        if config.compiled_blocks and kernel is not None and compiled is not None:
            model.compiled_blocks = CompiledBlocks(compiled, kernel, model)
        context = min(config.max_seq_len, shape.max_positions)
        room = context + config.max_tree_nodes  # cache columns one session may reach
        cache = PagedKVCache(
            num_layers=shape.num_layers,
            num_slots=config.max_sessions,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            max_seq_len=room,
            num_tokens=config.kv_tokens or config.max_sessions * room,
            dtype=dtype,
            device=config.device,
            block_size=config.kv_block_size,
            share_prefixes=config.prefix_caching and fuse is None,
        )
        graphs = None
        if config.cuda_graphs and device.type == "cuda":
            graphs = CudaGraphs(cache.block_size, cache.max_blocks * cache.block_size)
        return cls(model, tokenizer, cache, model_id, context, device, graphs)

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

    @property
    def kernel_threads(self) -> int:
        """The threads of the compiled bfloat16 kernel its linear layers run on; 0 for none."""
        head = self.model.lm_head
        return head.kernel.threads if isinstance(head, Bf16Linear) else 0

    @property
    def row_block(self) -> int:
        """Rows its forward computes in blocks of: a batch of one row past a multiple of it
        costs about as much as one a whole block larger. The tile unit's 16 where the
        linear layers run on it (workers/engine/bf16_linear.py); 1 elsewhere."""
        head = self.model.lm_head
        return AMX_ROWS if isinstance(head, Bf16Linear) and head.kernel.amx else 1

    @property
    def cheap_rows(self) -> int:
        """Tokens a forward feeds for about the cost of one: the tile unit's block where
        the linear layers run on it; the bfloat16 kernel's first tile of KERNEL_ROWS
        elsewhere (a forward of 1 to 6 tokens behind 300 cached took 10.6-12.9 ms on a
        Zen 4, one of 8 took 15-16: bench/RESULTS.md, "Lookup during decode steps"); 1 where
        it was not measured (float32, CUDA). What decode steps' own drafts fill
        (workers/target/runner.py)."""
        head = self.model.lm_head
        if not isinstance(head, Bf16Linear):
            return 1
        return AMX_ROWS if head.kernel.amx else KERNEL_ROWS

    def torch_beside_kernel(self) -> None:
        """Puts torch on one thread where this engine runs the bfloat16 kernel: the kernel
        does a forward's products (and the attention) on its own threads, the rest is small
        ops one torch thread does as fast, and torch's idle threads would spin on the cores
        the kernel's need (bench/RESULTS.md: 8 chat streams 219 against 280 tokens/s;
        bench/DRAFT.md: distillation data 275-283 against 365-392). For the whole process:
        threads that run forwards take the count at their first parallel torch op."""
        if self.kernel_threads and torch.get_num_threads() > 1:
            log.info("torch on 1 thread beside the bfloat16 kernel's %d", self.kernel_threads)
            torch.set_num_threads(1)

    @cached_property
    def tokenizer_fingerprint(self) -> str:
        """`loader.tokenizer_fingerprint` of its tokenizer, hashed once (0.1 s for a 49k
        vocabulary, which an in-process decoder would pay on every generate)."""
        from workers.engine.loader import tokenizer_fingerprint

        if self.tokenizer is None:  # a test model: the vocabulary size is all there is to compare
            return f"vocab:{self.vocab_size}"
        return tokenizer_fingerprint(self.tokenizer)

    def info(self, role: str, max_tree_nodes: int, live_sessions: int) -> WorkerInfo:
        """What a worker over this engine says about itself (its Info call)."""
        tokenizer = self.tokenizer
        eos = ()
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos = (tokenizer.eos_token_id,)
        return WorkerInfo(
            role=role,
            model_id=self.model_id,
            tokenizer_fingerprint=self.tokenizer_fingerprint,
            vocab_size=self.vocab_size,
            context_length=self.context_length,
            max_sessions=self.num_slots,
            live_sessions=live_sessions,
            eos_token_ids=eos,
            max_tree_nodes=max_tree_nodes,
            kv_tokens=self.cache.capacity_tokens,
            kv_tokens_used=self.cache.used_tokens,
            feature_size=self.model.shape.hidden_size
            if role == "target" or self.model.takes_features
            else 0,
        )

    def forward(self, rows: list[SlotInput]) -> list[torch.Tensor]:
        """Runs one forward over several slots; returns logits (logits_for_b, V) per row.
        Takes the KV blocks a row still lacks (OutOfBlocks if the pool is short)."""
        return self.run(rows).logits

    @torch.inference_mode()
    def run(
        self, rows: list[SlotInput], features: torch.Tensor | None = None, kept: bool = False
    ) -> Forward:
        """`forward`, also returning every fed token's hidden state. `features` (N, E), the
        rows' tokens in order: the target states a feature draft pairs them with. With
        `kept`, logits only over the ids the LM head keeps (`model.kept`; all where None),
        not spread over the vocabulary."""
        for r in rows:
            self.cache.reserve(r.slot, r.prefix_len + len(r.parents))
        listed = self.model.compiled is not None
        if features is not None:
            features = features.to(self.device, next(self.model.parameters()).dtype)
        graphs = self.graphs
        widen = graphs.widen_for(sum(len(r.tokens) for r in rows)) if graphs else None
        batch = build_batch(rows, self.cache, self.device, listed, widen)
        if graphs is None:
            hidden = self.model.hidden(self.cache, batch, features)  # (N, E)
        else:
            hidden = graphs(partial(self.model.hidden, self.cache), batch, features)
        picked = torch.cat(
            [hidden[end - r.logits_for : end] for end, r in zip(batch.ends, rows, strict=True)]
        )  # (sum logits_for, E)
        readout = self.model.readout if kept else self.model.logits
        logits = readout(picked)  # (sum logits_for, V or K)
        if self.device.type != "cpu":  # the runners verify and sample on the CPU
            logits, hidden = logits.cpu(), hidden.cpu()
        return Forward(
            list(logits.split([r.logits_for for r in rows])),
            list(hidden.split([len(r.tokens) for r in rows])),
        )

    def commit(self, slot: int, prefix_len: int, keep: list[int]) -> None:
        """Keeps uncommitted entries `keep` (region offsets, increasing) after the prefix."""
        self.cache.commit(slot, prefix_len, keep)
