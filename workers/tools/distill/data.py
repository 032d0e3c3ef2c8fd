"""Distillation data: the target's own greedy answers and its next-token distributions.

An `Example` is one chat prompt followed by the target's greedy answer to it, with the
target's k most likely next tokens (and their log-probabilities) at every position, prompt
included. A request of two turns gives two: the second's prompt is the first turn, the
target's answer to it and the follow-up. The target runs on SpecSplit's own engine, batched
over KV slots, so the answers are the served engine's own greedy choices.

The cache is a folder of batch files `<split>-<index>.pt`, each written whole by one
rename, so an interrupted generation resumes at the first missing batch and a finished
one is never redone. Which prompts a batch holds depends only on (split, seed, index).
"""

from __future__ import annotations

import itertools
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
    eval_prompts: int  # requests of each held-out set answered for the agreement report
    max_new_tokens: int  # longest answer per turn
    long_new_tokens: int  # longest answer to a request for a long one
    batch_size: int  # requests answered per generate call
    top_k: int  # next-token candidates kept per position
    seed: int  # picks and orders the prompts
    states: bool = False  # keep the target's hidden states too (an EAGLE head's data)

    @property
    def context(self) -> int:
        """KV positions a conversation may need: a prompt with a passage and either two
        turns of answers or one long answer."""
        return 384 + max(2 * self.max_new_tokens, self.long_new_tokens)


@dataclass
class Example:
    ids: list[int]  # (N,) chat prompt, then the target's greedy answer (eos included if reached)
    prompt_len: int  # P: the answer starts at ids[P]
    top_ids: torch.Tensor  # (N-1, k) long: the target's k most likely tokens after ids[: t+1]
    top_logp: torch.Tensor  # (N-1, k) float32: their log-probabilities, descending
    # (N-1, E) bfloat16: the target's state (last layer, before the final norm) after each
    # fed token, all but the last; None where the data was made without them
    states: torch.Tensor | None = None

    @property
    def answer_len(self) -> int:
        return len(self.ids) - self.prompt_len


class Teacher:
    """The target on SpecSplit's native engine: greedy answers for a batch of prompts.

    Every prompt gets a KV slot. One forward prefills the new prompts (logits at every
    prompt position), then one forward per step decodes every unfinished answer by one
    token; a finished answer leaves the batch, so no step is spent on padding. The logits
    that choose each token also give the target's top-k at that position, and the same
    forwards the target's hidden states (kept when asked): no second pass.
    """

    def __init__(self, engine: Engine, tokenizer):
        self.engine = engine
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id

    @torch.inference_mode()
    def examples(
        self, prompts: list[list[int]], limits: list[int], k: int, states: bool = False
    ) -> list[Example]:
        """One Example per prompt: its greedy answer (up to its limit of new tokens), the
        top-k at every position and, if `states`, the target's state after each fed token."""
        if len(prompts) > self.engine.num_slots:
            raise ValueError(f"{len(prompts)} prompts for {self.engine.num_slots} KV slots")
        longest = max(len(p) + limit for p, limit in zip(prompts, limits, strict=True))
        if longest > self.engine.context_length:
            raise ValueError(f"{longest} tokens exceed the context of {self.engine.context_length}")
        seqs = [list(p) for p in prompts]
        tops: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in prompts]
        hidden: list[list[torch.Tensor]] = [[] for _ in prompts]

        def advance(indices: list[int], rows: list[SlotInput]) -> list[int]:
            """Runs `rows`, records the top-k (and states), appends the greedy token;
            returns the unfinished."""
            run = self.engine.run(rows)
            unfinished = []
            for i, out, fed in zip(indices, run.logits, run.hidden, strict=True):  # (T_i, V)
                values, ids = out.log_softmax(-1).topk(k, dim=-1)  # (T_i, k) each
                tops[i].append((ids, values))
                if states:
                    hidden[i].append(fed.to(torch.bfloat16, copy=True))  # (T_i, E)
                seqs[i].append(int(out[-1].argmax()))  # the engine's own greedy choice
                if seqs[i][-1] != self.eos and len(seqs[i]) - len(prompts[i]) < limits[i]:
                    unfinished.append(i)
            return unfinished

        live: list[int] = []
        for start in range(0, len(prompts), PREFILL_GROUP):  # logits at every prompt position
            group = list(range(start, min(start + PREFILL_GROUP, len(prompts))))
            chains = [
                SlotInput(i, 0, list(range(-1, len(seqs[i]) - 1)), seqs[i], len(seqs[i]))
                for i in group
            ]
            live += advance(group, chains)
        while live:  # one token for every unfinished answer per forward
            live = advance(live, [SlotInput(i, len(seqs[i]) - 1, [-1], seqs[i][-1:]) for i in live])
        return [
            Example(
                ids=seq,
                prompt_len=len(prompt),
                top_ids=torch.cat([t[0] for t in top]),
                top_logp=torch.cat([t[1] for t in top]),
                states=torch.cat(fed) if states else None,
            )
            for seq, prompt, top, fed in zip(seqs, prompts, tops, hidden, strict=True)
        ]

    @torch.inference_mode()
    def states_of(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """The target's state after each token but the last of each sequence, (N-1, E)
        bfloat16 each: what `examples(..., states=True)` records, for data made without."""
        found = []
        for start in range(0, len(sequences), PREFILL_GROUP):
            group = sequences[start : start + PREFILL_GROUP]
            rows = [
                SlotInput(i, 0, list(range(-1, len(ids) - 2)), ids[:-1])
                for i, ids in enumerate(group)
            ]
            found += [h.to(torch.bfloat16, copy=True) for h in self.engine.run(rows).hidden]
        return found


def answer(teacher: Teacher, requests: list[prompt_set.Request], spec: DataSpec) -> list[Example]:
    """One Example per turn, request by request. A later turn's prompt is the conversation
    so far, the target's own answers included, as a client would send it back."""
    histories: list[list[dict]] = [[] for _ in requests]
    made: list[list[Example]] = [[] for _ in requests]
    for turn in range(max(len(r.turns) for r in requests)):
        live = [i for i, r in enumerate(requests) if turn < len(r.turns)]
        for i in live:
            histories[i].append({"role": "user", "content": requests[i].turns[turn]})
        ids = [encode_chat(teacher.tokenizer, histories[i]) for i in live]
        limits = [
            spec.long_new_tokens if requests[i].long and turn == 0 else spec.max_new_tokens
            for i in live
        ]
        made_now = teacher.examples(ids, limits, spec.top_k, spec.states)
        for i, e in zip(live, made_now, strict=True):
            reply = teacher.tokenizer.decode(e.ids[e.prompt_len :], skip_special_tokens=True)
            histories[i].append({"role": "assistant", "content": reply})
            made[i].append(e)
    return [e for turns in made for e in turns]


def request_batches(split: str, spec: DataSpec) -> Iterator[list[prompt_set.Request]]:
    """The split's requests in batches; batch i is the same for the same (split, spec).

    `train` is grouped by shape (one turn, two turns, a long answer) so that no batch keeps
    decoding for a few long answers; a held-out set comes in order, so that its first
    requests hold every shape as the split does.
    """
    stream = prompt_set.requests(split, spec.seed)
    size = spec.batch_size
    if split != "train":
        while batch := list(itertools.islice(stream, size)):
            yield batch
        return
    groups: dict[tuple[int, bool], list[prompt_set.Request]] = {}
    for request in stream:
        group = groups.setdefault((len(request.turns), request.long), [])
        group.append(request)
        if len(group) == size:
            yield list(group)
            group.clear()
    yield from (group for _, group in sorted(groups.items()) if group)


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


HELD_OUT = ("heldout", "unlike")  # new topics of the training kinds; kinds never trained on


def collect(
    folder: Path, spec: DataSpec, teacher: Callable[[], Teacher], log: Log
) -> tuple[list[Example], dict[str, list[Example]]]:
    """(train, {held-out set: examples}): the cached batches, generating only what is missing.

    Each held-out set is the examples of its first `eval_prompts` requests (one per turn);
    train is batches until the answers hold `spec.tokens` tokens. `teacher` is called only
    if a batch is missing.
    """
    folder.mkdir(parents=True, exist_ok=True)
    n_batches = math.ceil(spec.eval_prompts / spec.batch_size)
    held = {}
    for split in HELD_OUT:
        batches = _fill(folder, split, spec, teacher, log, batches=n_batches)
        requests = itertools.islice(prompt_set.requests(split, spec.seed), spec.eval_prompts)
        held[split] = _flat(batches)[: sum(len(r.turns) for r in requests)]
    train = _fill(folder, "train", spec, teacher, log, tokens=spec.tokens)
    return _flat(train), held


def _flat(batches: list[list[Example]]) -> list[Example]:
    return [e for batch in batches for e in batch]


def _fill(
    folder: Path,
    split: str,
    spec: DataSpec,
    teacher: Callable[[], Teacher],
    log: Log,
    *,
    batches: int | None = None,
    tokens: int | None = None,
) -> list[list[Example]]:
    """The shortest run of the split's batches that holds `batches` batches, or else
    `tokens` answer tokens."""

    def more(made: list[list[Example]], answered: int) -> bool:
        if batches is not None:
            return len(made) < batches
        return tokens is not None and answered < tokens

    made: list[list[Example]] = []
    answered = 0
    for cached in load_batches(folder, split):  # a cache made for a bigger run serves a prefix
        if not more(made, answered):
            break
        made.append(cached)
        answered += sum(e.answer_len for e in cached)
    source = request_batches(split, spec)
    for _ in made:  # skip the requests of the cached batches
        next(source)
    start, fresh = time.perf_counter(), 0
    while more(made, answered):
        requests = next(source, None)
        if requests is None:
            if tokens:
                log(f"data {split}: the prompt set is exhausted at {answered} answer tokens")
            break
        examples = answer(teacher(), requests, spec)
        _save_batch(folder / f"{split}-{len(made):05d}.pt", examples)
        made.append(examples)
        new = sum(e.answer_len for e in examples)
        answered, fresh = answered + new, fresh + new
        rate = fresh / (time.perf_counter() - start)
        left = f", about {duration((tokens - answered) / rate)} left" if tokens else ""
        target = f"/{tokens}" if tokens else ""
        log(
            f"data {split}: batch {len(made)}, {answered}{target} answer tokens, "
            f"{rate:.1f} tokens/s{left}"
        )
    return made


def duration(seconds: float) -> str:
    """12s, 3m05s."""
    seconds = max(0, int(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"
