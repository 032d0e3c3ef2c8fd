"""Fixtures of the gateway tests: a tiny model on disk and gateways over in-process workers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.gateway.helpers import word_tokenizer, write_tiny_model
from workers.engine.eagle import init_eagle_head, save_eagle_head


@pytest.fixture(autouse=True)
def _single_thread():
    """Tiny models: parallel kernels only add synchronisation on a 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """The target: a tiny random Llama with the word tokenizer and a chat template."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "target")


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory) -> Path:
    """A draft model: the target with slightly perturbed weights (accepted often, not always)."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "draft", noise=0.01)


@pytest.fixture(scope="session")
def tiny_eagle_dir(tmp_path_factory, tiny_dir) -> Path:
    """A feature draft: a random EAGLE head over the target (lossless whatever it predicts)."""
    from transformers import AutoModelForCausalLM

    head, fuse = init_eagle_head(AutoModelForCausalLM.from_pretrained(tiny_dir), seed=5)
    out = tmp_path_factory.mktemp("tiny") / "eagle"
    return save_eagle_head(out, head, fuse, word_tokenizer())


@pytest.fixture(scope="session")
def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE without merges: one token per UTF-8 byte, like GPT-2's base alphabet."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["</s>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
