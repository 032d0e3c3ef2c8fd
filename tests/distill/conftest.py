"""A tiny target on disk: a random Llama from tests/engine/tiny.py and a word-level tokenizer
with a chat template, saved the way a real model directory is."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.engine.tiny import tiny_hf_model
from workers.tools.distill import prompts

VOCAB = 96
SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: the tiny config's bos/eos
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Word level over the most common words of the prompt templates; the rest is <unk>."""
    words: dict[str, int] = {}
    for text in [*prompts.TEMPLATES, "user assistant"]:
        for word in re.findall(r"\w+|[^\w\s]", text):
            words[word] = words.get(word, 0) + 1
    common = sorted(words, key=lambda w: (-words[w], w))[: VOCAB - len(SPECIALS)]
    vocab = {token: i for i, token in enumerate(SPECIALS + common)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS[1:]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_target(path: Path, seed: int = 0) -> Path:
    tiny_hf_model("llama", vocab=VOCAB, seed=seed).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    return save_tiny_target(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture(autouse=True, scope="package")
def one_thread():
    """Tiny models gain nothing from a second thread, and on a busy machine lose a lot."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
