"""`specsplit distill --method eagle` on a tiny random target: the head it saves is a feature
draft that speculates losslessly, training lowers its loss, and a stopped run resumes to
the very weights of a run that never stopped."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DynamicCache

from tests.distill.test_distill import check_draft_bench_table, settings
from workers.engine.batch import SlotInput
from workers.engine.eagle import VOCAB_FILE, draft_kind
from workers.engine.engine import Engine, EngineConfig
from workers.engine.loader import load_tokenizer
from workers.engine.text import encode_chat
from workers.loop.inprocess import build_local
from workers.protocol import TreeSpec
from workers.speculation.sampling import SamplingParams
from workers.tools.bench import draft as draft_bench
from workers.tools.distill import prompts
from workers.tools.distill.data import Teacher, load_batches
from workers.tools.distill.eagle import EagleTrainer, last_layer_output, target_states
from workers.tools.distill.run import distill

EAGLE = dict(method="eagle", steps=6, checkpoint_every=3, lr=3e-3)


@pytest.fixture(scope="module")
def trained(tiny_target, tmp_path_factory) -> tuple[Path, dict, list[str]]:
    out = tmp_path_factory.mktemp("eagle") / "head"
    logs: list[str] = []
    report = distill(settings(tiny_target, out, **EAGLE), log=logs.append)
    return out, report, logs


def test_a_trained_head_speculates_losslessly_and_learns(tiny_target, trained):
    out, report, logs = trained
    assert report["recipe"]["method"] == "eagle" and draft_kind(out) == "eagle"
    losses = [float(m) for line in logs for m in re.findall(r"loss ([0-9.]+)", line)]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert json.loads((out / "distill.json").read_text())["heldout"] == report["heldout"]

    target = EngineConfig(model=str(tiny_target), max_sessions=2, max_seq_len=256)
    plain, engine = build_local(target, "none")
    texts = prompts.take("heldout", 0, 3)
    chats = [encode_chat(engine.tokenizer, [{"role": "user", "content": t}]) for t in texts]
    expected = [plain.generate(ids, 20, SamplingParams()).token_ids for ids in chats]
    speculative, _ = build_local(target, str(out), TreeSpec(depth=3, branching=2, budget=6))
    runs = [speculative.generate(ids, 20, SamplingParams()) for ids in chats]
    assert [r.token_ids for r in runs] == expected
    assert sum(r.stats.draft_tokens for r in runs) > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_draft_bench_measures_a_head(tiny_target, trained, dtype):
    settings_ = draft_bench.DraftBenchSettings(
        target_model=str(tiny_target),
        draft_model=str(trained[0]),
        prompts=2,
        max_tokens=8,
        dtype=dtype,
    )
    table = draft_bench.run(settings_)
    check_draft_bench_table(table)
    assert f", {dtype}; load average" in table


def test_an_interrupted_head_resumes_to_the_same_weights(tiny_target, tmp_path, trained):
    whole, stopped = trained[0], tmp_path / "stopped"
    assert distill(settings(tiny_target, stopped, stop_after=3, **EAGLE), log=print) is None
    logs: list[str] = []
    distill(settings(tiny_target, stopped, **EAGLE), log=logs.append)
    assert "eagle: resuming from step 3 of 6" in logs
    for name in ("model.safetensors", "eagle_fuse.safetensors"):
        a, b = load_file(whole / name), load_file(stopped / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_head_trains_on_the_states_the_target_had_while_answering(tiny_target, trained):
    """The teacher keeps each answer's states from the forwards that chose its tokens; data
    made without them get the same states from one more pass of the same engine."""
    engine = Engine.load(EngineConfig(str(tiny_target), max_sessions=8, max_seq_len=256))
    teacher = Teacher(engine, load_tokenizer(tiny_target))
    kept = [e for batch in load_batches(trained[0] / "checkpoint" / "data", "train") for e in batch]
    assert all(e.states.shape == (len(e.ids) - 1, engine.model.shape.hidden_size) for e in kept)
    assert all(e.states.dtype == torch.bfloat16 for e in kept)
    made_without = [dataclasses.replace(e, states=None) for e in kept[:10]]
    for e, computed in zip(kept, target_states(lambda: teacher, made_without), strict=False):
        torch.testing.assert_close(computed, e.states, rtol=0, atol=0)


def test_a_head_trains_on_data_made_for_a_model_draft(tiny_target, tmp_path):
    out, quiet = tmp_path / "from-model-data", lambda _: None
    assert distill(settings(tiny_target, out, stop_after=0), quiet) is None  # data, no states
    assert all(
        e.states is None
        for batch in load_batches(out / "checkpoint" / "data", "train")
        for e in batch
    )
    report = distill(settings(tiny_target, out, **EAGLE), quiet)
    assert draft_kind(out) == "eagle" and report["heldout"]["top1"] >= 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_head_reads_out_only_the_ids_it_keeps(tiny_target, trained, tmp_path, dtype):
    """--vocab-top 64 of the tiny target's 96 ids: the head's LM head holds those rows, the
    others get -inf (never proposed), and the kept ids' logits are the full head's."""
    out, report, _ = trained
    kept = load_file(out / VOCAB_FILE)["ids"]
    assert report["kept_vocab"] == len(kept) == 64 and torch.equal(kept, kept.sort().values)
    full = tmp_path / "all-ids"
    shutil.copytree(out, full)
    (full / VOCAB_FILE).unlink()
    config = dict(max_sessions=1, max_seq_len=64, dtype=dtype)
    heads = [Engine.load(EngineConfig(str(d), **config)) for d in (out, full)]
    assert heads[0].model.lm_head.out_features == 64
    row = SlotInput(0, 0, [-1, 0, 1], [5, 9, 17], logits_for=3)
    states = torch.randn(3, heads[0].model.shape.hidden_size)  # (3, E)
    reduced, every = (h.run([row], states).logits[0] for h in heads)  # (3, V) each
    unkept = torch.ones(every.shape[1], dtype=torch.bool)
    unkept[kept] = False
    assert torch.isneginf(reduced[:, unkept]).all()
    torch.testing.assert_close(reduced[:, kept], every[:, kept], rtol=0, atol=0)
    columns = heads[0].run([row], states, kept=True).logits[0]  # (3, K): the kept ids' alone
    torch.testing.assert_close(columns, reduced[:, kept], rtol=0, atol=0)


def served_chain(trainer, ids, states, start: int, levels: int) -> list[torch.Tensor]:
    """The states a served head predicts drafting a chain from committed position `start`:
    the committed tokens fed one pass (the target's states), then one token a level, each
    fed the state the head predicted for the one before, on the same cache.

    ids: (T,) long; states: (T, E) -> levels x (E,)"""
    head = trainer.head
    embedded = head.model.embed_tokens(ids[None])  # (1, T, E)
    before = torch.cat([torch.zeros_like(states[:1]), states[:-1]])[None]  # (1, T, E)
    cache = DynamicCache(config=head.config)
    x = trainer.fuse(torch.cat([before, embedded], dim=-1))[:, : start + 1]
    positions = torch.arange(start + 1)[None]
    out = last_layer_output(head, inputs_embeds=x, position_ids=positions, cache=cache)
    chain = [out[0, -1]]
    for t in range(start + 1, start + levels):
        x = trainer.fuse(torch.cat([chain[-1][None, None], embedded[:, t : t + 1]], dim=-1))
        step = last_layer_output(
            head, inputs_embeds=x, position_ids=torch.tensor([[t]]), cache=cache
        )
        chain.append(step[0, -1])
    return chain


@torch.no_grad()
def test_each_trained_level_is_what_a_served_chain_computes(tiny_target):
    """Level k of the training forward at position t equals a served head's k-th state
    drafting from t - k + 1 on its own cache, padded rows included (EAGLE-3's test)."""
    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    e = target.config.hidden_size
    trainer = EagleTrainer(target, seed=0, kept=torch.arange(target.config.vocab_size)).eval()
    torch.nn.init.normal_(trainer.fuse.weight, std=0.05)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (2, 12), generator=gen)
    states = torch.randn(2, 12, e, generator=gen)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0  # the second row is 9 tokens long
    levels = trainer(ids, states, mask, 3)
    for row, length in ((0, 12), (1, 9)):
        for start in range(length - 2):
            chain = served_chain(trainer, ids[row, :length], states[row, :length], start, 3)
            for k, predicted in enumerate(chain):
                torch.testing.assert_close(levels[k][row, start + k], predicted)
    assert all(torch.isfinite(level).all() for level in levels)


def test_a_finished_head_learns_more_levels(tiny_target, trained, tmp_path):
    """--init-from starts the layer and fuse from a head; --levels 2 reports each level's
    top-1 and saves a head that still speculates losslessly."""
    out, logs = tmp_path / "levels", []
    first = EagleTrainer(
        AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32),
        seed=0,
        kept=load_file(trained[0] / VOCAB_FILE)["ids"],
    )
    first.init_from(trained[0])
    saved = load_file(trained[0] / "eagle_fuse.safetensors")["weight"].float()
    torch.testing.assert_close(first.fuse.weight, saved)
    extra = {**EAGLE, "levels": 2, "init_from": trained[0]}
    report = distill(settings(tiny_target, out, **extra), log=logs.append)
    assert report["recipe"]["levels"] == 2
    assert len(report["heldout"]["top1_by_level"]) == 2
    assert report["heldout"]["top1_by_level"][0] == report["heldout"]["top1"]
    assert any("top-1 by level" in line for line in logs)
    target = EngineConfig(model=str(tiny_target), max_sessions=2, max_seq_len=256)
    plain, engine = build_local(target, "none")
    chat = encode_chat(engine.tokenizer, [{"role": "user", "content": "Name three rivers."}])
    speculative, _ = build_local(target, str(out), TreeSpec(depth=3, branching=2, budget=6))
    run = speculative.generate(chat, 20, SamplingParams())
    assert run.token_ids == plain.generate(chat, 20, SamplingParams()).token_ids


def test_a_head_from_other_kept_ids_is_refused(tiny_target, trained, tmp_path):
    trainer = EagleTrainer(
        AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32),
        seed=0,
        kept=torch.arange(10),
    )
    with pytest.raises(ValueError, match="keeps other target ids"):
        trainer.init_from(trained[0])
