"""`specsplit distill`: make a small draft for a target from the target's own behaviour.

Steps, each resumable:
  1. data: the target answers templated chat requests (one or two turns) greedily
     (batched on the native engine, one KV slot per request); its top-k next-token
     distributions over prompt and answer are cached in OUT/checkpoint/data/;
  2. vocabulary: the K target ids the training data uses most get draft rows;
  3. train: KL against the target, checkpointed to OUT/checkpoint/state.pt (weights,
     optimizer, step, RNG states) every --checkpoint-every steps;
  4. export: OUT becomes a plain model directory (config.json, model.safetensors, the
     target's tokenizer files) that `--draft-model OUT` loads like any other;
  5. report: top-1 / top-3 agreement of the saved draft with the target's greedy token on
     both held-out sets (new topics of the training kinds; kinds never trained on),
     printed and written to OUT/distill.json.
Run the same command again after an interruption and it goes on where it stopped.

`--method eagle` keeps step 1 and trains an EAGLE-style feature head instead
(workers/tools/distill/eagle.py): no vocabulary step, its own checkpoint
(OUT/checkpoint/eagle.pt), and OUT becomes a head directory (workers/engine/eagle.py).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field
from pydantic_settings import BaseSettings

from workers.engine.engine import Engine, EngineConfig
from workers.settings import EMBEDDED_MODEL, parse, settings_config
from workers.tools.distill import prompts as prompt_set
from workers.tools.distill.data import HELD_OUT, DataSpec, Example, Teacher, collect, duration
from workers.tools.distill.eagle import HeadSpec, export_eagle, target_states, train_eagle
from workers.tools.distill.model import (
    DraftTrainer,
    choose_vocab,
    draft_config,
    export,
    init_from_target,
    residual_axes,
)
from workers.tools.distill.train import (
    TOP,
    Checkpoint,
    TrainSpec,
    agreement,
    kl_objective,
    train,
)

INIT_SEQUENCES = 48  # training sequences whose target activations choose the draft's axes
SAVE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# options that must not change while OUT/checkpoint holds their work
DATA_RECIPE = (
    *("target", "teacher_dtype", "max_new_tokens", "long_new_tokens", "gen_batch", "top_k"),
    "seed",
)
TRAIN_RECIPE = (
    *("layers", "hidden", "intermediate", "vocab_top", "tokens", "eval_prompts", "steps"),
    *("batch_size", "lr", "prompt_weight"),
)
# what an EAGLE head's training (and its kept vocabulary) depends on
EAGLE_RECIPE = ("method", "steps", "batch_size", "lr", "vocab_top", "levels", "init_from")


class DistillSettings(BaseSettings):
    model_config = settings_config("distill")

    target: str = Field(EMBEDDED_MODEL, description="alias, directory, .gguf or HF id")
    method: Literal["model", "eagle"] = Field(
        "model",
        description="model: a small LM (--layers, --hidden, --vocab-top); eagle: an EAGLE-style "
        "feature head, one layer fed the target's hidden states, reading out --vocab-top "
        "target ids (workers/engine/eagle.py)",
    )
    out: Path = Field(description="draft directory to write; checkpoints go to OUT/checkpoint")
    layers: int = Field(2, ge=1, description="decoder layers (the target's first ones)")
    hidden: int = Field(144, ge=1, description="draft width, a multiple of the target's heads")
    intermediate: int = Field(0, ge=0, description="MLP width; 0 = the target's")
    vocab_top: int = Field(
        8192,
        ge=0,
        description="target ids given draft rows (a model's embedding, a head's LM head); 0 = all",
    )
    tokens: int = Field(100000, ge=1, description="target answer tokens to train on")
    eval_prompts: int = Field(
        32, ge=1, description="requests of each held-out set for the agreement report"
    )
    max_new_tokens: int = Field(128, ge=1, description="longest target answer per turn")
    long_new_tokens: int = Field(
        320, ge=1, description="longest target answer to a request for a long one"
    )
    gen_batch: int = Field(32, ge=1, description="prompts the target answers at once (KV slots)")
    teacher_dtype: Literal["float32", "bfloat16", "auto"] = Field(
        "float32",
        description="the dtype the target answers in (its greedy tokens are the data): float32 "
        "is transformers' text; bfloat16 is what `make run` serves where SpecSplit's kernel "
        "builds, and generates faster (bench/DRAFT.md); auto as `specsplit serve --dtype auto`",
    )
    top_k: int = Field(32, ge=1, description="target candidates kept per position for the KL")
    levels: int = Field(
        1,
        ge=1,
        le=8,
        description="eagle: tree levels trained; 1 feeds the target's states only, N also trains "
        "levels 2..N fed the head's own predicted states, as a served tree expands them "
        "(EAGLE-3's training-time test; a step costs about N times as much)",
    )
    init_from: Path | None = Field(
        None,
        description="eagle: a head directory to start the layer and fuse from (the same target "
        "and kept ids), e.g. to train more --levels into a finished head",
    )
    steps: int = Field(496, ge=1, description="optimizer steps")
    batch_size: int = Field(16, ge=1, description="sequences per optimizer step")
    lr: float = Field(1e-3, gt=0, description="peak learning rate")
    prompt_weight: float = Field(0.0, ge=0, description="loss weight of prompt positions")
    seed: int = Field(0, description="picks the prompts, initialises and orders the training")
    checkpoint_every: int = Field(50, ge=1, description="steps between checkpoints")
    stop_after: int | None = Field(None, ge=0, description="stop this run at that step")
    threads: int = Field(0, ge=0, description="torch CPU threads; 0 = torch's default")
    save_dtype: str = Field("float16", description="float16, bfloat16 or float32 weights")


def distill(s: DistillSettings, log=print) -> dict | None:
    """Runs (or resumes) a distillation; returns the report, or None if stopped early."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from workers.engine.loader import load_tokenizer, resolve_model

    if s.save_dtype not in SAVE_DTYPES:
        raise ValueError(f"--save-dtype must be one of {', '.join(SAVE_DTYPES)}")
    if s.threads:
        torch.set_num_threads(s.threads)
    folder = s.out / "checkpoint"
    _check_recipe(folder, s)
    path = resolve_model(s.target)
    tokenizer = load_tokenizer(path)
    target_config = AutoConfig.from_pretrained(path)
    loaded: dict = {}

    def target_hf():
        if "hf" not in loaded:
            log(f"loading the target {s.target}")
            loaded["hf"] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return loaded["hf"]

    spec = DataSpec(
        *(s.tokens, s.eval_prompts, s.max_new_tokens, s.long_new_tokens),
        *(s.gen_batch, s.top_k, s.seed),
        states=s.method == "eagle",
    )

    threads = torch.get_num_threads()  # training's; the teacher's kernel takes as many

    def teacher() -> Teacher:
        if "teacher" not in loaded:
            log(f"loading the target {s.target} to answer, in {s.teacher_dtype}")
            engine = Engine.load(
                EngineConfig(
                    s.target, dtype=s.teacher_dtype, max_sessions=s.gen_batch,
                    max_seq_len=spec.context, kernel_threads=threads,
                )
            )  # fmt: skip
            engine.torch_beside_kernel()  # until the data is made
            loaded["teacher"] = Teacher(engine, tokenizer)
        return loaded["teacher"]

    try:
        examples, held = collect(folder / "data", spec, teacher, log)
        if s.method == "eagle":
            states = {split: target_states(teacher, e) for split, e in held.items()}
            states["train"] = target_states(teacher, examples)
    finally:
        loaded.pop("teacher", None)  # its engine is not needed to train
        torch.set_num_threads(threads)
    kept = choose_vocab(examples, target_config.vocab_size, s.vocab_top, tokenizer.all_special_ids)
    if s.method == "eagle":
        return distill_eagle(s, target_hf(), path, (examples, held), states, kept, log)
    config = draft_config(target_config, s.layers, s.hidden, s.intermediate)
    torch.manual_seed(s.seed)
    trainer = DraftTrainer(config, kept)
    checkpoint = Checkpoint(folder / "state.pt")
    if not checkpoint.path.is_file():
        sample = [e.ids for e in examples[:INIT_SEQUENCES]]
        axes = residual_axes(target_hf(), s.layers, s.hidden, sample)
        init_from_target(trainer, target_hf(), axes)
    answer_tokens = sum(e.answer_len for e in examples)
    log(
        f"train: {len(examples)} prompts, {answer_tokens} answer tokens, kept vocabulary "
        f"{len(kept)} of {config.vocab_size}, draft {_millions(trainer.body)}M body parameters"
    )
    steps = TrainSpec(s.steps, s.batch_size, s.lr, s.prompt_weight, s.checkpoint_every, s.seed)
    objective = kl_objective(trainer, examples, held["heldout"], s.prompt_weight)
    lengths = [len(e.ids) for e in examples]
    if not train(trainer, lengths, steps, checkpoint, objective, log, s.stop_after):
        return None

    export(trainer, s.out, path, SAVE_DTYPES[s.save_dtype])
    saved = AutoModelForCausalLM.from_pretrained(s.out, dtype=torch.float32).eval()
    results = {split: saved_agreement(saved, held[split], trainer) for split in HELD_OUT}
    report = write_report(
        s,
        examples,
        checkpoint,
        TRAIN_RECIPE,
        kept_vocab=len(kept),
        vocab_size=config.vocab_size,
        kept_coverage_heldout=_coverage(held["heldout"], trainer.slot_of, len(kept)),
        **results,
    )
    for split, result in results.items():
        log(
            f"done: agreement with the target's greedy token on {split}: top-1 "
            f"{result['top1']:.3f}, top-{TOP} {result[f'top{TOP}']:.3f} over "
            f"{result['positions']} answer positions ({len(held[split])} answers); unkept "
            f"argmax {result['unkept_argmax']}"
        )
    log(f"saved {s.out} ({report['size_bytes'] / 1e6:.1f} MB)")
    return report


def distill_eagle(
    s: DistillSettings, target_hf, path: Path, data, states, kept, log
) -> dict | None:
    """Trains, exports and reports an EAGLE-style head (workers/tools/distill/eagle.py) on
    `data` (train examples, {held-out set: examples}) and the target's `states` of each,
    its LM head keeping the target ids `kept` (K,)."""
    examples, held = data
    steps = TrainSpec(s.steps, s.batch_size, s.lr, 0.0, s.checkpoint_every, s.seed)
    folder = s.out / "checkpoint"
    head = HeadSpec(s.levels, s.init_from)
    trained = train_eagle(target_hf, data, states, kept, steps, folder, log, s.stop_after, head)
    if trained is None:
        return None
    trainer, results = trained
    export_eagle(trainer, s.out, path, SAVE_DTYPES[s.save_dtype])
    checkpoint = Checkpoint(folder / "eagle.pt")
    report = write_report(s, examples, checkpoint, EAGLE_RECIPE, kept_vocab=len(kept), **results)
    for split, result in results.items():
        log(
            f"done: agreement of the head (fed the target's states) with the target's greedy "
            f"token on {split}: top-1 {result['top1']:.3f}, top-{TOP} {result[f'top{TOP}']:.3f}"
            + _by_level(result)
        )
    log(f"saved {s.out} ({report['size_bytes'] / 1e6:.1f} MB)")
    return report


def _by_level(result: dict) -> str:
    levels = result.get("top1_by_level")
    return "" if levels is None else "; top-1 by level " + " / ".join(f"{a:.3f}" for a in levels)


def write_report(
    s: DistillSettings, examples: list[Example], checkpoint: Checkpoint, recipe, **fields
) -> dict:
    """OUT/distill.json: the recipe, the data, `fields`, the training time and the size."""
    state = torch.load(checkpoint.path, weights_only=False)
    report = {
        "target": s.target,
        "recipe": recipe_of(s, recipe),
        "train_prompts": len(examples),
        "train_answer_tokens": sum(e.answer_len for e in examples),
        **fields,
        "train_seconds": round(state["elapsed_s"], 1),
        "size_bytes": sum(f.stat().st_size for f in s.out.glob("*.safetensors")),
    }
    (s.out / "distill.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def saved_agreement(model, heldout: list[Example], trainer: DraftTrainer) -> dict:
    """Agreement of the exported directory itself (full-vocabulary logits, as served)."""
    unkept = [0]

    def top_ids(ids, mask):
        guesses = model(input_ids=ids, attention_mask=mask).logits.topk(TOP, dim=-1).indices
        unkept[0] += int((trainer.slot_of[guesses[..., 0]] == len(trainer.kept))[mask > 0].sum())
        return guesses

    result = agreement(heldout, top_ids, trainer.slot_of)
    return {**result, "unkept_argmax": unkept[0]}


def _coverage(examples: list[Example], slot_of: torch.Tensor, k: int) -> float:
    """Share of held-out tokens (prompt and answer) that have a draft row."""
    ids = torch.tensor([t for e in examples for t in e.ids])
    return round(float((slot_of[ids] < k).float().mean()), 4)


def _millions(module: torch.nn.Module) -> float:
    params = sum(p.numel() for n, p in module.named_parameters() if "embed_tokens" not in n)
    return round(params / 1e6, 2)


def _check_recipe(folder: Path, s: DistillSettings) -> None:
    """Refuses to mix a checkpoint's work with different options; records them on first use."""
    meta = folder / "recipe.json"
    names, state = (EAGLE_RECIPE, "eagle.pt") if s.method == "eagle" else (TRAIN_RECIPE, "state.pt")
    recipe = recipe_of(s, names)
    if meta.is_file():  # an option newer than the file reads as its default
        defaults = {n: _jsonable(f.default) for n, f in DistillSettings.model_fields.items()}
        old = defaults | json.loads(meta.read_text())
        data_diff = [n for n in (*DATA_RECIPE, "prompt_set") if old.get(n) != recipe[n]]
        if data_diff:
            raise ValueError(
                f"{folder} holds data made with other options ({_diff(old, recipe, data_diff)}); "
                f"pass the same options or use another --out"
            )
        train_diff = [n for n in names if old.get(n) != recipe[n]]
        if train_diff and (folder / state).is_file():
            raise ValueError(
                f"{folder}/{state} was trained with other options "
                f"({_diff(old, recipe, train_diff)}); pass the same options, or delete "
                f"{state} to train again on the cached data"
            )
    folder.mkdir(parents=True, exist_ok=True)
    meta.write_text(json.dumps(recipe, indent=2) + "\n")


def _diff(old: dict, new: dict, names: list[str]) -> str:
    return ", ".join(
        f"the prompt set was version {old.get(n)!r}, now {new[n]!r}"
        if n == "prompt_set"
        else f"--{n.replace('_', '-')} was {old.get(n)!r}, now {new[n]!r}"
        for n in names
    )


def recipe_of(s: DistillSettings, names: tuple[str, ...]) -> dict:
    """The options the data and the training depend on, and the request set's version."""
    recipe = {name: _jsonable(getattr(s, name)) for name in (*DATA_RECIPE, *names)}
    return {**recipe, "prompt_set": prompt_set.VERSION}


def _jsonable(value):
    return str(value) if isinstance(value, Path) else value


def main(argv: list[str]) -> None:
    s = parse(DistillSettings, argv)
    start = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{duration(time.perf_counter() - start):>6}] {message}", flush=True)

    try:
        distill(s, log)
    except (ValueError, RuntimeError) as error:
        sys.exit(f"specsplit distill: {error}")
