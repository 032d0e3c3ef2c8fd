"""`specsplit generate`: one prompt, decoded in-process with speculation."""

from __future__ import annotations

import json
import sys

from pydantic import Field

from workers.engine.engine import EngineConfig
from workers.engine.text import encode, encode_chat
from workers.loop.inprocess import build_local
from workers.protocol import TreeSpec
from workers.settings import EMBEDDED_MODEL, EngineOptions, parse, settings_config
from workers.speculation.sampling import SamplingParams


class GenerateSettings(EngineOptions):
    model_config = settings_config("generate")

    prompt: str = Field(description="the text to continue (or the user message with --chat)")
    chat: bool = Field(False, description="wrap the prompt in the model's chat template")
    max_tokens: int = Field(64, ge=1, description="most new tokens")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass")
    top_k: int = Field(0, ge=0, description="0 = off")
    seed: int | None = Field(None, description="makes sampling reproducible")
    target_model: str = Field(EMBEDDED_MODEL, description="alias, directory, .gguf, HF id")
    draft_model: str = Field("ngram", description="a model, 'ngram' or 'none'")
    tree_depth: int = Field(6, ge=0, description="most draft tokens along one path")
    tree_branching: int = Field(2, ge=1, description="children per expanded node; 1 = chain")
    tree_budget: int = Field(16, ge=0, description="most tree nodes per round")
    json_output: bool = Field(False, alias="json", description="print one JSON object")


def main(argv: list[str]) -> None:
    s = parse(GenerateSettings, argv)
    spec = TreeSpec(depth=s.tree_depth, branching=s.tree_branching, budget=s.tree_budget)
    try:
        params = SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed
        )
        config = EngineConfig(
            model=s.target_model,
            device=s.device,
            dtype=s.dtype,
            max_sessions=1,
            max_seq_len=s.max_seq_len,
            cache_dir=s.model_cache,
        )
        decoder, engine = build_local(config, s.draft_model, spec)
        tokenizer = engine.tokenizer
        if s.chat:
            ids = encode_chat(tokenizer, [{"role": "user", "content": s.prompt}])
        else:
            ids = encode(tokenizer, s.prompt)
        if len(ids) + s.max_tokens > engine.context_length:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({s.max_tokens}) exceeds the "
                f"context of {engine.context_length} tokens"
            )
        gen = decoder.generate(ids, s.max_tokens, params)
    except (ValueError, RuntimeError) as error:
        sys.exit(f"specsplit generate: {error}")
    text = tokenizer.decode(gen.token_ids, skip_special_tokens=True)
    if s.json_output:
        out = {"text": text, "token_ids": gen.token_ids, "finish_reason": gen.finish_reason}
        print(json.dumps({**out, "stats": gen.summary()}))
    else:
        print(text)
