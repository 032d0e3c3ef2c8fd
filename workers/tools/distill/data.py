"""Distillation data: the target's own greedy answers and its next-token distributions.

An `Example` is one chat prompt followed by the target's greedy answer to it, with the
target's k most likely next tokens (and their log-probabilities) at every position, prompt
included. The target runs on SpecSplit's own engine, batched over KV slots, so the
answers are the served engine's own greedy choices.

The cache is a folder of batch files `<split>-<index>.pt`, each written whole by one
rename, so an interrupted generation resumes at the first missing batch and a finished
one is never redone. Which prompts a batch holds depends only on (split, seed, index).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.engine.batch import SlotInput
from workers.engine.engine import Engine
from workers.engine.text import encode_chat
from workers.tools.distill import prompts as prompt_set

Log = Callable[[str], None]
PREFILL_GROUP = 8  # prompts per prefill forward: bounds its (sum of lengths, V) logits


@dataclass(frozen=True)
class DataSpec:
    """What to ask the target and how much of it."""

    tokens: int  # target answer tokens to collect for training (whole batches, so a bit more)
    eval_prompts: int  # held-out prompts answered for the agreement report
    max_new_tokens: int  # longest answer per prompt
    batch_size: int  # prompts answered per generate call
    top_k: int  # next-token candidates kept per position
    seed: int  # picks and orders the prompts


@dataclass
class Example:
    ids: list[int]  # (N,) chat prompt, then the target's greedy answer (eos included if reached)
    prompt_len: int  # P: the answer starts at ids[P]
    top_ids: torch.Tensor  # (N-1, k) long: the target's k most likely tokens after ids[: t+1]
    top_logp: torch.Tensor  # (N-1, k) float32: their log-probabilities, descending

    @property
    def answer_len(self) -> int:
        return len(self.ids) - self.prompt_len


class Teacher:
    """The target on SpecSplit's native engine: greedy answers for a batch of prompts.

    Every prompt gets a KV slot. One forward prefills the new prompts (logits at every
    prompt position), then one forward per step decodes every unfinished answer by one
    token; a finished answer leaves the batch, so no step is spent on padding. The logits
    that choose each token also give the target's top-k at that position: no second pass.
    """

    def __init__(self, engine: Engine, tokenizer):
        self.engine = engine
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id

    @torch.inference_mode()
    def examples(self, prompts: list[list[int]], max_new_tokens: int, k: int) -> list[Example]:
        """One Example per prompt: its greedy answer and the top-k at every position."""
        if len(prompts) > self.engine.num_slots:
            raise ValueError(f"{len(prompts)} prompts for {self.engine.num_slots} KV slots")
        longest = max(len(p) for p in prompts) + max_new_tokens
        if longest > self.engine.context_length:
            raise ValueError(f"{longest} tokens exceed the context of {self.engine.context_length}")
        seqs = [list(p) for p in prompts]
        tops: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in prompts]

        def advance(indices: list[int], logits: list[torch.Tensor]) -> list[int]:
            """Records the top-k, appends the greedy token; returns the unfinished."""
            unfinished = []
            for i, out in zip(indices, logits, strict=True):  # out: (T_i, V)
                values, ids = out.log_softmax(-1).topk(k, dim=-1)  # (T_i, k) each
                tops[i].append((ids, values))
                seqs[i].append(int(out[-1].argmax()))  # the engine's own greedy choice
                if seqs[i][-1] != self.eos and len(seqs[i]) - len(prompts[i]) < max_new_tokens:
                    unfinished.append(i)
            return unfinished

        live: list[int] = []
        for start in range(0, len(prompts), PREFILL_GROUP):  # logits at every prompt position
            group = list(range(start, min(start + PREFILL_GROUP, len(prompts))))
            chains = [
                SlotInput(i, 0, list(range(-1, len(seqs[i]) - 1)), seqs[i], len(seqs[i]))
                for i in group
            ]
            live += advance(group, self.engine.forward(chains))
        while live:  # one token for every unfinished answer per forward
            steps = [SlotInput(i, len(seqs[i]) - 1, [-1], seqs[i][-1:]) for i in live]
            live = advance(live, self.engine.forward(steps))
        return [
            Example(
                ids=seq,
                prompt_len=len(prompt),
                top_ids=torch.cat([t[0] for t in top]),
                top_logp=torch.cat([t[1] for t in top]),
            )
            for seq, prompt, top in zip(seqs, prompts, tops, strict=True)
        ]


def batch_prompts(split: str, seed: int, batch_size: int) -> Iterator[list[str]]:
    """The split's prompts in batches; batch i is the same for the same (split, seed, size)."""
    stream = prompt_set.prompts(split, seed)
    while batch := [text for _, text in zip(range(batch_size), stream, strict=False)]:
        yield batch


def load_batches(folder: Path, split: str) -> list[list[Example]]:
    """Every cached batch of a split, in order, up to the first missing one."""
    batches = []
    while (path := folder / f"{split}-{len(batches):05d}.pt").is_file():
        batches.append([Example(**e) for e in torch.load(path, weights_only=False)])
    return batches


def _save_batch(path: Path, examples: list[Example]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save([vars(e) for e in examples], tmp)
    tmp.replace(path)


def collect(
    folder: Path, spec: DataSpec, teacher: Callable[[], Teacher], log: Log
) -> tuple[list[Example], list[Example]]:
    """(train, heldout) examples: the cached batches, generating only what is missing.

    Held-out comes first (a fixed number of prompts), then train batches until the
    answers hold `spec.tokens` tokens. `teacher` is called only if a batch is missing.
    """
    folder.mkdir(parents=True, exist_ok=True)
    n_eval_batches = math.ceil(spec.eval_prompts / spec.batch_size)
    heldout = _fill(folder, "heldout", spec, teacher, log, lambda b, _: b < n_eval_batches)
    train = _fill(folder, "train", spec, teacher, log, lambda _, n: n < spec.tokens)
    return [e for b in train for e in b], [e for b in heldout for e in b][: spec.eval_prompts]


def _fill(
    folder: Path,
    split: str,
    spec: DataSpec,
    teacher: Callable[[], Teacher],
    log: Log,
    more: Callable[[int, int], bool],
) -> list[list[Example]]:
    """The shortest run of batches for which `more(batches, answer tokens)` turns False."""
    batches: list[list[Example]] = []
    answered = 0
    for cached in load_batches(folder, split):  # a cache made for a bigger run serves a prefix
        if not more(len(batches), answered):
            break
        batches.append(cached)
        answered += sum(e.answer_len for e in cached)
    source = batch_prompts(split, spec.seed, spec.batch_size)
    for _ in batches:  # skip the prompts of the cached batches
        next(source)
    start, fresh = time.perf_counter(), 0
    goal = spec.tokens if split == "train" else None
    while more(len(batches), answered):
        texts = next(source, None)
        if texts is None:
            log(f"data {split}: the prompt set is exhausted at {answered} answer tokens")
            break
        t = teacher()
        ids = [encode_chat(t.tokenizer, [{"role": "user", "content": m}]) for m in texts]
        examples = t.examples(ids, spec.max_new_tokens, spec.top_k)
        _save_batch(folder / f"{split}-{len(batches):05d}.pt", examples)
        batches.append(examples)
        new = sum(e.answer_len for e in examples)
        answered, fresh = answered + new, fresh + new
        rate = fresh / (time.perf_counter() - start)
        left = f", about {duration((goal - answered) / rate)} left" if goal else ""
        target = f"/{goal}" if goal else ""
        log(
            f"data {split}: batch {len(batches)}, {answered}{target} answer tokens, "
            f"{rate:.1f} tokens/s{left}"
        )
    return batches


def duration(seconds: float) -> str:
    """12s, 3m05s."""
    seconds = max(0, int(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"
