"""Tiny random Llama-family models that tests build themselves (no files, no hub).

`tiny_engine` puts its engine on $SPECSPLIT_TEST_DEVICE ("cpu" unless set): with "cuda"
the engine, worker and decoding tests that use it run their engines on a GPU
(bench/GPU.md), the transformers references staying on the CPU."""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from workers.engine.engine import Engine, EngineConfig


def tiny_config(kind: str = "llama", vocab: int = 96, seed: int = 0):
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=kind == "llama",
    )
    if kind == "qwen2":
        return Qwen2Config(**common)
    if kind == "llama3":
        return LlamaConfig(
            **common,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    return LlamaConfig(**common)


def tiny_hf_model(kind: str = "llama", vocab: int = 96, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, vocab), dtype=torch.float32)
    with torch.no_grad():  # random init is small; widen it so argmaxes are well separated
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
            elif "bias" in str(p):
                p.normal_(0.0, 0.1)
    return model.eval()


def engine_device() -> str:
    """The torch device tests run their engines on."""
    return os.environ.get("SPECSPLIT_TEST_DEVICE", "cpu")


def tiny_engine(kind: str = "llama", vocab: int = 96, seed: int = 0, slots: int = 4) -> Engine:
    device = engine_device()
    hf = tiny_hf_model(kind, vocab, seed).to(device)
    config = EngineConfig(model=f"tiny-{kind}", device=device, max_sessions=slots, max_seq_len=256)
    return Engine.from_hf(hf, None, config, model_id=f"tiny-{kind}-{seed}")
