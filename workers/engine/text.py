"""Text to token ids with a model's own tokenizer and chat template."""

from __future__ import annotations


def encode_chat(
    tokenizer, messages: list[dict], generation_prompt: bool = True, continue_final: bool = False
) -> list[int]:
    """The chat template rendered, then tokenized as is: with the generation prompt (an
    assistant turn opened), or with the last message left open to be continued."""
    text = tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=generation_prompt,
        continue_final_message=continue_final,
        tokenize=False,
    )
    return encode(tokenizer, text)


def encode(tokenizer, text: str) -> list[int]:
    """Plain text to ids; templates and prompts already carry their special tokens."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def stop_token_ids(tokenizer) -> frozenset[int]:
    """The tokens that end a generation: the tokenizer's end-of-sequence token."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return frozenset() if eos is None else frozenset({eos})
