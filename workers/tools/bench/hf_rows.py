"""The transformers rows: `generate` greedy, assisted generation, prompt lookup, in-process.

Each request is one `generate` call with a streamer that notes when new
tokens arrive (the first `put` is the prompt; assisted generation puts
several tokens at once), so time to first token and inter-token latency are
measured as they are for SpecSplit's stream.
"""

from __future__ import annotations

import time

import torch
from transformers.generation.streamers import BaseStreamer

from workers.tools.bench.measure import Timed


class Clock(BaseStreamer):
    """Notes (arrival, tokens) of every chunk of new tokens."""

    def __init__(self, timed: Timed):
        self.timed = timed
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:  # generate puts the prompt first
            self.prompt_seen = True
            return
        self.timed.chunks.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        pass


def hf_request(model, tokenizer, prompt: list[int], max_tokens: int, **kwargs) -> Timed:
    """One greedy `generate` call; `kwargs` pick assisted generation or prompt lookup."""
    eos = tokenizer.eos_token_id
    timed = Timed(time.perf_counter())
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
            streamer=Clock(timed),
            **kwargs,
        )
    timed.end = time.perf_counter()
    tokens = out[0, len(prompt) :].tolist()
    if eos in tokens:  # the stop token counts, as it does in a SpecSplit response's usage
        tokens = tokens[: tokens.index(eos) + 1]
    timed.tokens = len(tokens)
    timed.text = tokenizer.decode(tokens, skip_special_tokens=True)
    return timed
