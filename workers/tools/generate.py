"""`specsplit generate`: one prompt, decoded in-process with speculation.

With `--rounds` it prints one line per speculation round as the round is
committed (as the treehacks seed's client does): tree nodes drafted, of them
accepted, the target's bonus token, the round's time and the text it added;
then a totals line, then the text.
"""

from __future__ import annotations

import json
import sys
from typing import Literal

from pydantic import Field

from workers.engine.engine import EngineConfig
from workers.engine.text import encode, encode_chat
from workers.loop.inprocess import build_local
from workers.loop.state import Generation, Round
from workers.protocol import TreeSpec
from workers.settings import EMBEDDED_MODEL, EngineOptions, parse, settings_config
from workers.speculation.acceptance import AcceptanceRule
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
    acceptance: Literal["exact", "threshold", "typical"] = Field(
        "exact", description="exact (lossless) or a lossy rule: threshold, typical"
    )
    threshold: float = Field(0.1, gt=0.0, le=1.0, description="threshold: least p_target")
    epsilon: float = Field(0.09, gt=0.0, le=1.0, description="typical: the probability cap")
    delta: float = Field(0.3, gt=0.0, le=1.0, description="typical: the entropy scale")
    rounds: bool = Field(False, description="print one line per round, then the totals")
    json_output: bool = Field(False, alias="json", description="print one JSON object")


class RoundPrinter:
    """Prints each round as it is committed: drafted, accepted, bonus, time, the text added."""

    def __init__(self, tokenizer, out=sys.stdout):
        self.tokenizer = tokenizer
        self.out = out
        self.tokens: list[int] = []
        self.text = ""
        self.count = 0

    def __call__(self, round_: Round, seconds: float) -> None:
        self.count += 1
        self.tokens += round_.tokens
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        added = text[len(self.text) :] if text.startswith(self.text) else text
        self.text = text
        bonus = self.tokenizer.decode(round_.tokens[-1:]) if round_.tokens else ""
        print(
            f"round {self.count:3d}  drafted {round_.drafted:3d}  accepted {round_.accepted:3d}"
            f"  bonus {json.dumps(bonus, ensure_ascii=False):12s} {seconds * 1000:7.1f} ms"
            f"  +{json.dumps(added, ensure_ascii=False)}",
            file=self.out,
            flush=True,
        )

    def totals(self, gen: Generation) -> None:
        s = gen.summary()
        print(
            f"total    {len(gen.token_ids)} tokens in {s['verify_steps']} rounds, drafted "
            f"{s['draft_tokens']}, accepted {s['accepted_tokens']} "
            f"({100 * s['acceptance_rate']:.1f}%), {s['mean_accepted_length']:.2f} tokens per "
            f"round, {gen.elapsed_s:.2f} s ({s['tokens_per_second']:.1f} tokens/s), "
            f"finish {gen.finish_reason}",
            file=self.out,
            flush=True,
        )


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
            attention=s.attention,
            kernel_threads=s.kernel_threads,
            amx=s.amx,
            compiled_blocks=s.compiled_blocks,
            cuda_graphs=s.cuda_graphs,
            max_sessions=1,
            max_seq_len=s.max_seq_len,
            cache_dir=s.model_cache,
        )
        rule = AcceptanceRule(s.acceptance, s.threshold, s.epsilon, s.delta)
        decoder, engine = build_local(config, s.draft_model, spec, rule)
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
        # with --json the round lines go to stderr, so stdout stays one JSON object
        printer = RoundPrinter(tokenizer, sys.stderr if s.json_output else sys.stdout)
        gen = decoder.generate(ids, s.max_tokens, params, printer if s.rounds else None)
    except (ValueError, RuntimeError) as error:
        sys.exit(f"specsplit generate: {error}")
    text = tokenizer.decode(gen.token_ids, skip_special_tokens=True)
    if s.rounds:
        printer.totals(gen)
    if s.json_output:
        out = {"text": text, "token_ids": gen.token_ids, "finish_reason": gen.finish_reason}
        stats = {**gen.summary(), "acceptance": rule.kind, "lossless": rule.lossless}
        print(json.dumps({**out, "stats": stats}))
    else:
        print(text)
