"""Training the draft on the target's distributions, with checkpoints it can resume from.

Loss: KL(p || q) at every position, p the target's next-token distribution (its top-k,
renormalised) and q the draft's over all V target ids (`DraftTrainer`). Answer positions
weigh 1, prompt positions `prompt_weight`: the draft serves answers, prompts only add data.

Batches are a pure function of (seed, step): each epoch is a seeded permutation, cut into
batches of similar lengths (little padding), in a seeded order. With the weights, the
optimizer state and the step restored, a resumed run takes the same steps as one that
was never stopped and ends at the same weights.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.tools.distill.data import Example, Log, duration
from workers.tools.distill.model import DraftTrainer

TOP = 3  # agreement is reported for top-1 and top-TOP


@dataclass(frozen=True)
class TrainSpec:
    steps: int  # optimizer steps in all
    batch_size: int  # sequences per step
    lr: float  # peak AdamW learning rate (linear warm-up, cosine down to a tenth)
    prompt_weight: float  # loss weight of prompt positions; answer positions weigh 1
    checkpoint_every: int  # steps between checkpoints (and held-out agreement lines)
    seed: int  # orders the batches


@dataclass
class Batch:
    slots: torch.Tensor  # (B, T) long: table row of each input token (K = unkept)
    mask: torch.Tensor  # (B, T) long: 1 on real tokens, 0 on right padding
    top_slots: torch.Tensor  # (B, T, k) long: table rows of the target's top-k next tokens
    top_p: torch.Tensor  # (B, T, k) float: their renormalised probabilities (0 on padding)
    weight: torch.Tensor  # (B, T) float: loss weight of each position
    greedy: torch.Tensor  # (B, T) long: the target's most likely next token (-1 on padding)


def collate(examples: list[Example], slot_of: torch.Tensor, prompt_weight: float) -> Batch:
    """Position t of a row reads ids[: t+1] and is scored on the target's guess for ids[t+1]."""
    width = max(len(e.ids) for e in examples) - 1  # T
    k = examples[0].top_ids.shape[1]
    b = len(examples)
    ids = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, width, dtype=torch.long)
    top_ids = torch.zeros(b, width, k, dtype=torch.long)
    top_p = torch.zeros(b, width, k)
    weight = torch.zeros(b, width)
    greedy = torch.full((b, width), -1, dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.ids) - 1
        ids[i, :n] = torch.tensor(e.ids[:-1])
        mask[i, :n] = 1
        top_ids[i, :n] = e.top_ids
        top_p[i, :n] = e.top_logp.softmax(-1)
        weight[i, :n] = prompt_weight
        weight[i, e.prompt_len - 1 : n] = 1.0  # positions that predict answer tokens
        greedy[i, :n] = e.top_ids[:, 0]
    return Batch(slot_of[ids], mask, slot_of[top_ids], top_p, weight, greedy)


def kl_loss(trainer: DraftTrainer, batch: Batch) -> torch.Tensor:
    """Weighted mean of KL(p || q) over the positions that weigh anything."""
    at = batch.weight > 0  # (B, T)
    logq = trainer(batch.slots, batch.mask, at)  # (P, K+1)
    p = batch.top_p[at]  # (P, k)
    cross = -(p * logq.gather(-1, batch.top_slots[at])).sum(-1)  # (P,)
    entropy = -(p * p.clamp_min(1e-12).log()).sum(-1)  # (P,)
    weight = batch.weight[at]  # (P,)
    return ((cross - entropy) * weight).sum() / weight.sum()


def epoch_batches(lengths: list[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Example indices of every batch of one epoch, in the order they are trained on."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=gen).tolist()
    chunk = batch_size * 8  # sort within chunks of 8 batches: similar lengths, still mixed
    batches = []
    for start in range(0, len(order), chunk):
        part = sorted(order[start : start + chunk], key=lambda i: lengths[i])
        batches += [part[i : i + batch_size] for i in range(0, len(part), batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]


def lr_at(step: int, spec: TrainSpec) -> float:
    warmup = max(1, min(100, spec.steps // 10))
    if step < warmup:
        return spec.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, spec.steps - warmup)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.01)


@dataclass
class Checkpoint:
    """DIR/checkpoint/state.pt: everything a run needs to go on where it stopped."""

    path: Path

    def load(self, trainer: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, float]:
        """Restores weights, optimizer and RNGs; returns (step, training seconds so far)."""
        state = torch.load(self.path, weights_only=False)
        trainer.load_state_dict(state["trainer"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        return state["step"], state["elapsed_s"]

    def save(self, step, trainer, optimizer, elapsed_s: float) -> None:
        state = {
            "step": step,
            "trainer": trainer.state_dict(),
            "optimizer": optimizer.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            "elapsed_s": elapsed_s,
        }
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        torch.save(state, tmp)
        tmp.replace(self.path)  # a checkpoint is the old one or the new one, never half


@dataclass(frozen=True)
class Objective:
    """What a training run minimises and how it reports (the model method's KL, or an
    EAGLE head's loss, workers/tools/distill/eagle.py)."""

    loss: Callable[[list[int]], torch.Tensor]  # the loss of a batch, given example indices
    held_out: Callable[[], tuple[float, float]]  # held-out top-1 and top-TOP agreement
    label: str = "train"  # what its log lines start with
    loss_name: str = "KL"


def train(
    trainer: torch.nn.Module,
    lengths: list[int],
    spec: TrainSpec,
    checkpoint: Checkpoint,
    objective: Objective,
    log: Log,
    stop_after: int | None = None,
) -> bool:
    """Trains from the checkpoint (if any) to `spec.steps` over examples of `lengths`
    tokens; False if it stopped at `stop_after`. Only parameters that require grad train."""
    params = [p for p in trainer.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, spec.lr)
    step, elapsed, label = 0, 0.0, objective.label
    if checkpoint.path.is_file():
        step, elapsed = checkpoint.load(trainer, optimizer)
        log(f"{label}: resuming from step {step} of {spec.steps}")
    per_epoch = len(epoch_batches(lengths, spec.batch_size, spec.seed, 0))
    trainer.train()
    run_start, run_steps, losses = time.perf_counter(), 0, []
    while step < spec.steps:
        if stop_after is not None and step >= stop_after:
            checkpoint.save(step, trainer, optimizer, elapsed)
            log(f"{label}: stopped at step {step} (--stop-after); run again to resume")
            return False
        start = time.perf_counter()
        epoch, index = divmod(step, per_epoch)
        chosen = epoch_batches(lengths, spec.batch_size, spec.seed, epoch)[index]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, spec)
        loss = objective.loss(chosen)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step, run_steps = step + 1, run_steps + 1
        elapsed += time.perf_counter() - start
        losses.append(loss.item())
        if step % spec.checkpoint_every == 0 or step == spec.steps:
            checkpoint.save(step, trainer, optimizer, elapsed)
            rate = (time.perf_counter() - run_start) / run_steps
            top1, top3 = objective.held_out()
            log(
                f"{label}: step {step}/{spec.steps} (epoch {step / per_epoch:.1f}), "
                f"{objective.loss_name} {sum(losses) / len(losses):.3f}, held-out top-1 "
                f"{top1:.3f} top-{TOP} {top3:.3f}, {rate:.2f} s/step, "
                f"about {duration(rate * (spec.steps - step))} left"
            )
            losses = []
            trainer.train()
    return True


def kl_objective(
    trainer: DraftTrainer, examples: list[Example], heldout: list[Example], prompt_weight: float
) -> Objective:
    """The model method's: KL against the target on a batch (`kl_loss`)."""

    def loss(chosen: list[int]) -> torch.Tensor:
        batch = collate([examples[i] for i in chosen], trainer.slot_of, prompt_weight)
        return kl_loss(trainer, batch)

    return Objective(loss, lambda: _trainer_agreement(trainer, heldout))


Scorer = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@torch.no_grad()
def agreement(examples: list[Example], top_ids: Scorer, slot_of: torch.Tensor) -> dict:
    """How often the draft's top-1 / top-3 holds the target's greedy token on answer positions.

    `top_ids(ids (B, T), mask (B, T))` gives the draft's TOP most likely target ids
    (B, T, TOP), -1 for "some unkept token".
    """
    hits1 = hits3 = positions = 0
    for start in range(0, len(examples), 4):
        chunk = examples[start : start + 4]
        batch = collate(chunk, slot_of, prompt_weight=0.0)  # weight 1 exactly on answers
        ids = torch.zeros_like(batch.slots)
        for i, e in enumerate(chunk):
            ids[i, : len(e.ids) - 1] = torch.tensor(e.ids[:-1])
        guesses = top_ids(ids, batch.mask)  # (B, T, TOP)
        on = batch.weight == 1.0  # (B, T)
        target = batch.greedy[on]  # (P,)
        picked = guesses[on]  # (P, TOP)
        hits1 += int((picked[:, 0] == target).sum())
        hits3 += int((picked == target[:, None]).any(-1).sum())
        positions += int(on.sum())
    return {
        "top1": hits1 / max(1, positions),
        f"top{TOP}": hits3 / max(1, positions),
        "positions": positions,
    }


def _trainer_agreement(trainer: DraftTrainer, heldout: list[Example]) -> tuple[float, float]:
    trainer.eval()
    ids_of_slot = torch.cat([trainer.kept, torch.tensor([-1])])  # slot K: an unkept token

    def top_ids(ids, mask):
        return ids_of_slot[trainer(trainer.slot_of[ids], mask).topk(TOP, dim=-1).indices]

    result = agreement(heldout, top_ids, trainer.slot_of)
    return result["top1"], result[f"top{TOP}"]
