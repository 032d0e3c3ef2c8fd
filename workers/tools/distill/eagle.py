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
gets them for every committed token. With `levels` > 1 it also trains the levels
a served tree expands beyond the first (EAGLE-3's training-time test): level k
at position t is fed the state the head itself predicted at level k - 1 for
position t - 1, and attends, as the served head's cache holds them then, to the
level-1 entries of positions up to t - k + 1 and to one entry of each level
between (`level_mask`); every level is scored against the target's state and
distribution at t, and the loss is the levels' mean.

The embedding, final norm and LM head are the target's and stay frozen; the
fuse and the one decoder layer train. Checkpoints (OUT/checkpoint/eagle.pt)
and batches work as the model method's (workers/tools/distill/train.py), so a
stopped run resumes to the same weights.

Shapes: B sequences, T positions, E the target's hidden size, k top-k, V the
target's vocabulary, K kept ids, P answer positions, L levels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from transformers import DynamicCache

from workers.engine.eagle import init_eagle_head, load_fuse, load_vocab, save_eagle_head
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

    def init_from(self, head_dir: Path) -> None:
        """Starts the layer and the fuse from a head directory's (a finished head, say, that is
        to learn more levels); it must keep the same target ids."""
        theirs = load_vocab(head_dir)
        every = torch.arange(len(self.slot_of))
        if not torch.equal(every if theirs is None else theirs, self.kept):
            raise ValueError(f"{head_dir} keeps other target ids than this run's data chose")
        weights = load_file(Path(head_dir) / "model.safetensors")
        prefix = "model.layers."
        layers = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
        with torch.no_grad():
            self.head.model.layers.load_state_dict({k: v.float() for k, v in layers.items()})
            self.fuse.weight.copy_(load_fuse(head_dir, torch.float32, "cpu").weight)

    def forward(self, ids, states, mask, levels: int = 1) -> list[torch.Tensor]:
        """The predicted state after each token at levels 1 … `levels` (module docstring),
        fed as served: at level 1 token t with the target's state at t - 1, the first token
        with zeros (no state precedes it), so the served head's first cache entry is one
        training saw; at level k token t with level k - 1's prediction at t - 1.

        ids, mask: (B, T) long; states: (B, T, E) the target's -> L x (B, T, E)
        """
        embedded = self.head.model.embed_tokens(ids)  # (B, T, E)
        positions = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)  # (B, T)
        cache = DynamicCache(config=self.head.config)  # keys of the levels so far, in order
        fed, predicted = states, []
        for level in range(1, levels + 1):
            before = torch.cat([torch.zeros_like(fed[:, :1]), fed[:, :-1]], dim=1)  # (B, T, E)
            x = self.fuse(torch.cat([before, embedded], dim=-1))
            fed = last_layer_output(
                self.head,
                inputs_embeds=x,
                position_ids=positions,
                attention_mask=level_mask(mask, level, x.dtype),
                cache=cache,
                use_cache=True,
            )
            predicted.append(fed)
        return predicted

    def kept_logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """predicted (P, E) -> (P, K): the head's logits of the kept ids."""
        normed = self.head.model.norm(predicted)  # (P, E)
        return normed @ self.head.lm_head.weight[self.kept].T


def level_mask(mask: torch.Tensor, level: int, dtype: torch.dtype) -> torch.Tensor:
    """What level `level`'s entry at position t sees as the served head's cache holds it
    when a chain drafted from committed position c = t - level + 1 reaches t: level 1's
    entries at positions up to c, level j's (1 < j <= level) at c + j - 1; padding
    keys never (a padded query sees itself, to stay finite).

    mask: (B, T) 1 on real tokens -> (B, 1, T, level x T) additive, keys level by level
    """
    width = mask.shape[1]
    query = torch.arange(width)[:, None]  # (T, 1)
    key = torch.arange(width)[None]  # (1, T)
    blocks = [key <= query - level + 1]
    blocks += [key == query - level + j for j in range(2, level + 1)]
    seen = torch.cat(blocks, dim=1)[None] & (mask > 0).repeat(1, level)[:, None]  # (B, T, LT)
    own = torch.zeros_like(seen)
    own[:, :, (level - 1) * width :] = torch.eye(width, dtype=torch.bool)
    lowest = torch.finfo(dtype).min
    additive = torch.zeros(seen.shape, dtype=dtype).masked_fill(~(seen | own), lowest)
    return additive[:, None]


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


def loss_of(trainer: EagleTrainer, b: HeadBatch, levels: int = 1) -> torch.Tensor:
    """The mean over levels of smooth L1 to the target's next state plus CLS_WEIGHT x the
    token loss: the kept ids' softmax against the target's top-k (its unkept ones, which
    the head can never propose, left out). Level k scores positions t >= k - 1, whose
    chain starts at a real position."""
    total = torch.zeros(())
    for level, predicted in enumerate(trainer(b.ids, b.states, b.mask, levels), start=1):
        reached = torch.arange(b.ids.shape[1])[None] >= level - 1  # (1, T)
        valid, answer = (b.mask > 0) & reached, b.answer & reached  # (B, T)
        regression = F.smooth_l1_loss(predicted[valid], b.states[valid])
        logp = trainer.kept_logits(predicted[answer]).log_softmax(-1)  # (P, K)
        slots = trainer.slot_of[b.top_ids[answer]]  # (P, k): -1 where not kept
        p = b.top_p[answer] * (slots >= 0)  # (P, k)
        cls = -(p * logp.gather(1, slots.clamp(min=0))).sum(-1).mean()
        total = total + regression + CLS_WEIGHT * cls
    return total / levels


@torch.no_grad()
def agreement(trainer: EagleTrainer, heldout: list[Example], states, levels: int = 1) -> dict:
    """How often the head's top-1 / top-TOP holds the target's greedy token on answer
    positions, fed the target's states, reading out its kept ids (as served: one head step
    after committed tokens); with `levels` > 1 also the top-1 of each level, fed its own
    states beyond the first (`top1_by_level`, level 1 first)."""
    trainer.eval()
    hits, positions, hits3 = [0] * levels, [0] * levels, 0
    for e, s in zip(heldout, states, strict=True):
        b = collate([e], [s])
        greedy = b.top_ids[..., 0]  # (1, T)
        for level, predicted in enumerate(trainer(b.ids, b.states, b.mask, levels)):
            at = b.answer & (torch.arange(b.ids.shape[1])[None] >= level)  # (1, T)
            guesses = trainer.kept[trainer.kept_logits(predicted[at]).topk(TOP, dim=-1).indices]
            hits[level] += int((guesses[:, 0] == greedy[at]).sum())
            positions[level] += len(guesses)
            if level == 0:
                hits3 += int((guesses == greedy[at][:, None]).any(-1).sum())
    trainer.train()
    top1 = [h / max(1, n) for h, n in zip(hits, positions, strict=True)]
    result = {"top1": top1[0], f"top{TOP}": hits3 / max(1, positions[0])}
    if levels > 1:
        result["top1_by_level"] = top1
    return result


@dataclass(frozen=True)
class HeadSpec:
    """What an EAGLE run trains beyond the shared TrainSpec."""

    levels: int = 1  # tree levels trained (module docstring); 1 = teacher-forced only
    init_from: Path | None = None  # a head directory whose layer and fuse it starts from


def train_eagle(
    target_hf,
    data: tuple[list[Example], dict[str, list[Example]]],
    states: dict[str, list[torch.Tensor]],
    kept: torch.Tensor,
    spec: TrainSpec,
    folder: Path,
    log: Log,
    stop_after: int | None = None,
    head: HeadSpec = HeadSpec(),
) -> tuple[EagleTrainer, dict[str, dict]] | None:
    """Trains (or resumes) a head from `target_hf`'s embedding, norm and LM head; returns
    it and its agreement on each held-out set (the log follows "heldout" as it trains), or
    None when it stopped at `stop_after`. `data` is (train examples, {held-out set:
    examples}); `states` the target's states of each (`target_states`), "train" included;
    agreement reads out the `kept` (K,) target ids, as the exported head will."""
    examples, held = data
    torch.manual_seed(spec.seed)
    trainer = EagleTrainer(target_hf, spec.seed, kept)
    if head.init_from is not None:
        trainer.init_from(head.init_from)  # a resumed run's checkpoint then overrides it

    def loss(chosen: list[int]) -> torch.Tensor:
        batch = collate([examples[i] for i in chosen], [states["train"][i] for i in chosen])
        return loss_of(trainer, batch, head.levels)

    def held_out() -> tuple[float, float]:
        result = agreement(trainer, held["heldout"], states["heldout"])
        return result["top1"], result[f"top{TOP}"]

    objective = Objective(loss, held_out, label="eagle", loss_name="loss")
    lengths = [len(s) for s in states["train"]]
    checkpoint = Checkpoint(folder / "eagle.pt")
    if not train(trainer, lengths, spec, checkpoint, objective, log, stop_after):
        return None
    results = {
        split: agreement(trainer, e, states[split], head.levels) for split, e in held.items()
    }
    return trainer, results


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
