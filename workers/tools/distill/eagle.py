"""`specsplit distill --method eagle`: train an EAGLE-style feature head for a target.

The data is the model method's (the target's greedy answers to templated chat
prompts, with its top-k next-token distributions, OUT/checkpoint/data/), with the
target's hidden states kept by the same forwards: the served engine's own states, in
the teacher's dtype (data made without them get them from one more pass). The
head (workers/engine/eagle.py) learns what the target computes next: fed the
target's state at position t and token t + 1, it regresses the target's state
at t + 1 (smooth L1, EAGLE's loss) and, read out through the target's final
norm and the kept rows of its LM head (the ids the served head reads out,
`--vocab-top`), the target's next-token distribution: cross-entropy (weight
CLS_WEIGHT) of a softmax over all K kept ids against the target's top-k
probabilities, so every kept id competes, not only the target's top k.
Training feeds the target's own states (teacher forcing), as a served head
gets them for every committed token.

The embedding, final norm and LM head are the target's and stay frozen; the
fuse and the one decoder layer train. Checkpoints (OUT/checkpoint/eagle.pt)
and batches work as the model method's (workers/tools/distill/train.py), so a
stopped run resumes to the same weights.

Shapes: B sequences, T positions, E the target's hidden size, k top-k, V the
target's vocabulary, K kept ids, P answer positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from workers.engine.eagle import init_eagle_head, save_eagle_head
from workers.tools.distill.data import Example, Log, Teacher
from workers.tools.distill.train import TOP, Checkpoint, Objective, TrainSpec, train

# the token loss's weight beside the state regression: 1.0 over the kept ids beat EAGLE's 0.1
# over the target's top-k alone, 4.0, and the token loss without the regression
# (bench/DRAFT.md, "EAGLE heads on the teacher's own states")
CLS_WEIGHT = 1.0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def last_layer_output(model, **inputs) -> torch.Tensor:
    """The output of a transformers Llama's last decoder layer (before the final norm)."""
    seen: list[torch.Tensor] = []

    def grab(module, args, output):
        seen.append(output[0] if isinstance(output, tuple) else output)

    handle = model.model.layers[-1].register_forward_hook(grab)
    try:
        model.model(**inputs)
    finally:
        handle.remove()
    return seen[0]


def target_states(teacher: Callable[[], Teacher], examples: list[Example]) -> list[torch.Tensor]:
    """The target's state after every token but the last of each example, (N-1, E)
    bfloat16: the ones the teacher kept while answering, or else computed now by the same
    engine (data made without them)."""
    missing = [i for i, e in enumerate(examples) if e.states is None]
    found = teacher().states_of([examples[i].ids for i in missing]) if missing else []
    computed = dict(zip(missing, found, strict=True))
    return [computed[i] if e.states is None else e.states for i, e in enumerate(examples)]


class EagleTrainer(nn.Module):
    """A head while it trains: the fuse and the layer learn, the target's parts are frozen;
    it reads out the target ids `kept` ((K,) ascending), as the exported head will."""

    def __init__(self, target_hf, seed: int, kept: torch.Tensor):
        super().__init__()
        self.head, fuse = init_eagle_head(target_hf, seed)
        self.head.requires_grad_(False)
        self.head.model.layers.requires_grad_(True)
        self.fuse = fuse.requires_grad_(True)
        self.kept = kept  # (K,)
        self.slot_of = torch.full((target_hf.config.vocab_size,), -1, dtype=torch.long)  # (V,)
        self.slot_of[kept] = torch.arange(len(kept))

    def forward(self, ids, states, mask) -> torch.Tensor:
        """The predicted state after each token, fed as served: token t with the target's
        state at t - 1, the first token with zeros (no state precedes it), so the served
        head's first cache entry is one training saw.

        ids, mask: (B, T) long; states: (B, T, E) the target's -> (B, T, E)
        """
        before = torch.cat([torch.zeros_like(states[:, :1]), states[:, :-1]], dim=1)  # (B, T, E)
        x = self.fuse(torch.cat([before, self.head.model.embed_tokens(ids)], dim=-1))
        positions = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)  # (B, T)
        return last_layer_output(
            self.head, inputs_embeds=x, position_ids=positions, attention_mask=mask
        )

    def kept_logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """predicted (P, E) -> (P, K): the head's logits of the kept ids."""
        normed = self.head.model.norm(predicted)  # (P, E)
        return normed @ self.head.lm_head.weight[self.kept].T


@dataclass(frozen=True)
class HeadBatch:
    """Right-padded sequences (each example but its last token, whose state no forward
    computed); position t's prediction guesses token t + 1."""

    ids: torch.Tensor  # (B, T) long
    states: torch.Tensor  # (B, T, E): the target's state after each token
    mask: torch.Tensor  # (B, T) long: 1 on real tokens
    top_ids: torch.Tensor  # (B, T, k) long: the target's top-k after each token
    top_p: torch.Tensor  # (B, T, k): their renormalised probabilities
    answer: torch.Tensor  # (B, T) bool: the position guesses an answer token


def collate(examples: list[Example], states: list[torch.Tensor]) -> HeadBatch:
    """The batch of `examples` with their target `states` ((N-1, E) each)."""
    width = max(len(s) for s in states)  # T
    b, e_dim, k = len(examples), states[0].shape[1], examples[0].top_ids.shape[1]
    ids = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, width, dtype=torch.long)
    feats = torch.zeros(b, width, e_dim)
    top_ids = torch.zeros(b, width, k, dtype=torch.long)
    top_p = torch.zeros(b, width, k)
    answer = torch.zeros(b, width, dtype=torch.bool)
    for i, (e, s) in enumerate(zip(examples, states, strict=True)):
        n = len(s)  # the first N - 1 tokens; position t guesses ids[t + 1]
        ids[i, :n], mask[i, :n], feats[i, :n] = torch.tensor(e.ids[:n]), 1, s.float()
        top_ids[i, :n] = e.top_ids
        top_p[i, :n] = e.top_logp.softmax(-1)
        answer[i, max(0, e.prompt_len - 1) : n] = True
    return HeadBatch(ids, feats, mask, top_ids, top_p, answer)


def loss_of(trainer: EagleTrainer, b: HeadBatch) -> torch.Tensor:
    """Smooth L1 to the target's next state plus CLS_WEIGHT x the token loss: the kept
    ids' softmax against the target's top-k (its unkept ones, which the head can never
    propose, left out)."""
    predicted = trainer(b.ids, b.states, b.mask)  # (B, T, E)
    valid = b.mask > 0  # (B, T)
    regression = F.smooth_l1_loss(predicted[valid], b.states[valid])
    logp = trainer.kept_logits(predicted[b.answer]).log_softmax(-1)  # (P, K)
    slots = trainer.slot_of[b.top_ids[b.answer]]  # (P, k): -1 where not kept
    p = b.top_p[b.answer] * (slots >= 0)  # (P, k)
    cls = -(p * logp.gather(1, slots.clamp(min=0))).sum(-1).mean()
    return regression + CLS_WEIGHT * cls


@torch.no_grad()
def agreement(trainer: EagleTrainer, heldout: list[Example], states) -> dict:
    """How often the head's top-1 / top-TOP holds the target's greedy token on answer
    positions, fed the target's states, reading out its kept ids (as served: one head step
    after committed tokens)."""
    trainer.eval()
    hits1 = hits3 = positions = 0
    for e, s in zip(heldout, states, strict=True):
        b = collate([e], [s])
        predicted = trainer(b.ids, b.states, b.mask)[b.answer]  # (P, E)
        guesses = trainer.kept[trainer.kept_logits(predicted).topk(TOP, dim=-1).indices]  # (P, TOP)
        greedy = b.top_ids[b.answer][:, 0]  # (P,)
        hits1 += int((guesses[:, 0] == greedy).sum())
        hits3 += int((guesses == greedy[:, None]).any(-1).sum())
        positions += len(greedy)
    trainer.train()
    return {"top1": hits1 / max(1, positions), f"top{TOP}": hits3 / max(1, positions)}


def train_eagle(
    target_hf,
    data: tuple[list[Example], dict[str, list[Example]]],
    states: dict[str, list[torch.Tensor]],
    kept: torch.Tensor,
    spec: TrainSpec,
    folder: Path,
    log: Log,
    stop_after: int | None = None,
) -> tuple[EagleTrainer, dict[str, dict]] | None:
    """Trains (or resumes) a head from `target_hf`'s embedding, norm and LM head; returns
    it and its agreement on each held-out set (the log follows "heldout" as it trains), or
    None when it stopped at `stop_after`. `data` is (train examples, {held-out set:
    examples}); `states` the target's states of each (`target_states`), "train" included;
    agreement reads out the `kept` (K,) target ids, as the exported head will."""
    examples, held = data
    torch.manual_seed(spec.seed)
    trainer = EagleTrainer(target_hf, spec.seed, kept)

    def loss(chosen: list[int]) -> torch.Tensor:
        chosen_states = [states["train"][i] for i in chosen]
        return loss_of(trainer, collate([examples[i] for i in chosen], chosen_states))

    def held_out() -> tuple[float, float]:
        result = agreement(trainer, held["heldout"], states["heldout"])
        return result["top1"], result[f"top{TOP}"]

    objective = Objective(loss, held_out, label="eagle", loss_name="loss")
    lengths = [len(s) for s in states["train"]]
    checkpoint = Checkpoint(folder / "eagle.pt")
    if not train(trainer, lengths, spec, checkpoint, objective, log, stop_after):
        return None
    return trainer, {split: agreement(trainer, e, states[split]) for split, e in held.items()}


def export_eagle(trainer: EagleTrainer, out: Path, tokenizer_dir: Path, dtype) -> None:
    """Writes `out` as a head directory (workers/engine/eagle.py) with the target's tokenizer,
    its LM head reading out the trainer's kept ids (all V: no vocabulary file)."""
    trainer.head.to(dtype)
    trainer.fuse.to(dtype)
    every = len(trainer.kept) == trainer.head.config.vocab_size
    save_eagle_head(out, trainer.head, trainer.fuse, kept=None if every else trainer.kept)
    for name in TOKENIZER_FILES:  # copied as they are: the tokenizer fingerprints must match
        if (tokenizer_dir / name).is_file():
            (out / name).write_bytes((tokenizer_dir / name).read_bytes())
