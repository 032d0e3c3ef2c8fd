"""In-process speculative decoding: a drafter and a target runner in one loop.

Each round: propose (the draft's tree after the committed history), verify
(the target keeps the longest acceptable path and adds its bonus token),
commit, emit. The same calls cross the network when the two sides are gRPC
workers; here they are plain method calls.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from workers.draft.ngram import NgramDrafter
from workers.draft.runner import ModelDrafter
from workers.engine.engine import Engine, EngineConfig
from workers.engine.sessions import SessionTable
from workers.protocol import ProposeCall, TreeSpec, VerifyCall
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree
from workers.target.runner import TargetRunner

Drafter = ModelDrafter | NgramDrafter


@dataclass
class SpecStats:
    """Speculation counters of one generation."""

    draft_tokens: int = 0  # tree nodes proposed
    accepted_tokens: int = 0  # tree nodes the target accepted
    verify_steps: int = 0  # target forwards (rounds)
    emitted_tokens: int = 0  # accepted + bonus tokens
    elapsed_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per target forward (tau): accepted nodes plus the bonus token."""
        return self.emitted_tokens / self.verify_steps if self.verify_steps else 0.0

    def as_dict(self, generated: int) -> dict:
        return {
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "verify_steps": self.verify_steps,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "tokens_per_second": round(generated / self.elapsed_s, 3) if self.elapsed_s else 0.0,
        }


@dataclass
class Generation:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" when an end-of-sequence token was produced
    stats: SpecStats = field(default_factory=SpecStats)


def first_error(results: list) -> object:
    result = results[0]
    if isinstance(result, Exception):
        raise result
    return result


class SpecDecoder:
    def __init__(
        self,
        target: TargetRunner,
        drafter: Drafter | None,
        spec: TreeSpec = TreeSpec(),
        stop_ids: frozenset[int] = frozenset(),
    ):
        self.target = target
        self.drafter = drafter
        self.spec = spec
        self.stop_ids = stop_ids

    def rounds(
        self, prompt: list[int], max_tokens: int, params: SamplingParams, gen: Generation
    ) -> Iterator[list[int]]:
        """Yields the tokens each round emits; fills `gen` as it goes."""
        if not prompt:
            raise ValueError("the prompt is empty")
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        sid = uuid.uuid4().hex
        draft_base, draft_new = 0, list(prompt)
        target_base, target_new = 0, list(prompt)
        start = time.perf_counter()
        try:
            while len(gen.token_ids) < max_tokens:
                remaining = max_tokens - len(gen.token_ids)
                tree = TokenTree.empty()
                if self.drafter is not None:
                    spec = replace(
                        self.spec,
                        depth=min(self.spec.depth, remaining - 1),
                        temperature=params.temperature,
                        seed=params.seed,
                    )
                    call = ProposeCall(sid, draft_base, draft_new, spec)
                    tree = first_error(self.drafter.propose([call]))
                    draft_base, draft_new = draft_base + len(draft_new), []
                call = VerifyCall(sid, target_base, target_new, tree, params)
                outcome = first_error(self.target.verify([call]))
                target_base, target_new = target_base + len(target_new) + len(outcome.emitted), []
                draft_new = list(outcome.emitted)
                stats = gen.stats
                stats.draft_tokens += len(tree)
                stats.accepted_tokens += len(outcome.accepted)
                stats.verify_steps += 1
                stats.emitted_tokens += len(outcome.emitted)
                emitted = outcome.emitted[:remaining]
                stop = next((i for i, t in enumerate(emitted) if t in self.stop_ids), None)
                if stop is not None:
                    emitted, gen.finish_reason = emitted[: stop + 1], "stop"
                gen.token_ids.extend(emitted)
                stats.elapsed_s = time.perf_counter() - start
                yield emitted
                if stop is not None:
                    return
        finally:
            self.target.end(sid)
            if self.drafter is not None:
                self.drafter.end(sid)

    def generate(self, prompt: list[int], max_tokens: int, params: SamplingParams) -> Generation:
        gen = Generation()
        for _ in self.rounds(prompt, max_tokens, params, gen):
            pass
        return gen


def stop_token_ids(tokenizer) -> frozenset[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    return frozenset(ids)


def build_decoder(
    target: EngineConfig, draft_model: str = "ngram", spec: TreeSpec = TreeSpec()
) -> tuple[SpecDecoder, Engine]:
    """Loads the target (and a model draft) and joins them; returns the decoder and target."""
    from workers.engine.loader import tokenizer_fingerprint

    engine = Engine.load(target)
    runner = TargetRunner(engine, SessionTable(engine.num_slots))
    drafter: Drafter | None = None
    if draft_model == "ngram":
        drafter = NgramDrafter(SessionTable(1024), engine.vocab_size)
    elif draft_model != "none":
        draft = Engine.load(replace(target, model=draft_model))
        if tokenizer_fingerprint(draft.tokenizer) != tokenizer_fingerprint(engine.tokenizer):
            raise ValueError(
                f"draft {draft_model!r} and target {target.model!r} use different tokenizers"
            )
        drafter = ModelDrafter(draft, SessionTable(draft.num_slots))
    return SpecDecoder(runner, drafter, spec, stop_token_ids(engine.tokenizer)), engine
