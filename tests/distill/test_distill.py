"""`specsplit distill` on a tiny random target: the draft it saves is a plain model that
speculates losslessly, computes over all target ids what it was trained to, and a stopped
run resumes to the very weights of a run that never stopped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from workers.engine.engine import Engine, EngineConfig
from workers.engine.loader import load_tokenizer
from workers.engine.text import encode_chat
from workers.loop.inprocess import build_local
from workers.protocol import TreeSpec
from workers.speculation.sampling import SamplingParams
from workers.tools import cli
from workers.tools.bench import draft as draft_bench
from workers.tools.distill import prompts
from workers.tools.distill.data import Teacher, load_batches
from workers.tools.distill.model import DraftTrainer
from workers.tools.distill.run import DistillSettings, distill

TINY = {  # a run of seconds: 1-layer draft, ~150 answer tokens, 4 steps
    "layers": "1",
    "hidden": "32",
    "intermediate": "64",
    "vocab-top": "64",
    "tokens": "150",
    "eval-prompts": "4",
    "max-new-tokens": "12",
    "long-new-tokens": "20",
    "gen-batch": "8",
    "steps": "4",
    "batch-size": "4",
    "checkpoint-every": "2",
    "seed": "3",
}


def settings(target: Path, out: Path, **extra) -> DistillSettings:
    values = {k.replace("-", "_"): v for k, v in TINY.items()}
    return DistillSettings(target=str(target), out=out, **{**values, **extra})


@pytest.fixture(scope="module")
def draft(tiny_target, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("draft")
    assert distill(settings(tiny_target, out), log=lambda _: None) is not None
    return out


def test_saved_draft_speculates_losslessly(tiny_target, draft):
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in draft.iterdir()
    }
    target = EngineConfig(model=str(tiny_target), max_sessions=2, max_seq_len=256)
    plain, engine = build_local(target, "none")
    texts = prompts.take("heldout", 0, 3)
    chats = [encode_chat(engine.tokenizer, [{"role": "user", "content": t}]) for t in texts]
    expected = [plain.generate(ids, 20, SamplingParams()).token_ids for ids in chats]
    for tree in (TreeSpec(), TreeSpec(depth=4, branching=1, budget=4)):
        # build_local loads the draft like any model and refuses a different tokenizer
        speculative, _ = build_local(target, str(draft), tree)
        outputs = [speculative.generate(ids, 20, SamplingParams()).token_ids for ids in chats]
        assert outputs == expected


def test_saved_draft_computes_what_was_trained(tiny_target, draft):
    """The saved full-vocabulary model and the kept-vocabulary trainer give the same q."""
    state = torch.load(draft / "checkpoint" / "state.pt", weights_only=False)
    config = AutoModelForCausalLM.from_pretrained(draft).config
    trainer = DraftTrainer(config, state["trainer"]["kept"])
    trainer.load_state_dict(state["trainer"])
    with torch.no_grad():  # the directory holds float16 weights
        for p in trainer.parameters():
            p.copy_(p.half().float())
    saved = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    weight = saved.get_output_embeddings().weight  # (V, H), tied to the input embedding
    unkept = trainer.slot_of == len(trainer.kept)
    assert unkept.any() and (weight[unkept] == 0).all()
    assert weight.data_ptr() == saved.get_input_embeddings().weight.data_ptr()

    ids = torch.tensor([[1, 5, 17, 3, 40, 90, 2, 1, 7]])  # includes unkept ids
    mask = torch.ones_like(ids)
    with torch.no_grad():
        logq = trainer(trainer.slot_of[ids], mask)  # (1, T, K+1)
        full = saved(input_ids=ids).logits.log_softmax(-1)  # (1, T, V)
    assert torch.allclose(full.exp().sum(-1), torch.ones(1, ids.shape[1]), atol=1e-5)
    assert torch.allclose(full[..., trainer.kept], logq[..., :-1], atol=1e-4)
    unkept_logq = logq[..., -1:].expand(-1, -1, int(unkept.sum()))
    assert torch.allclose(full[..., unkept], unkept_logq, atol=1e-4)


def test_interrupted_run_resumes_to_the_same_weights(tiny_target, tmp_path, draft):
    whole = tmp_path / "whole"
    args = [arg for k, v in TINY.items() for arg in (f"--{k}", v)]
    cli.main(["distill", "--target", str(tiny_target), "--out", str(whole), *args])

    stopped = tmp_path / "stopped"
    logs: list[str] = []
    assert distill(settings(tiny_target, stopped, stop_after=2), log=logs.append) is None
    assert not (stopped / "model.safetensors").exists()
    assert torch.load(stopped / "checkpoint" / "state.pt", weights_only=False)["step"] == 2

    logs.clear()
    report = distill(settings(tiny_target, stopped), log=logs.append)
    assert "train: resuming from step 2 of 4" in logs
    assert not any(line.startswith(("loading the target", "data ")) for line in logs)  # cached

    a, b = load_file(whole / "model.safetensors"), load_file(stopped / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert report["heldout"] == json.loads((whole / "distill.json").read_text())["heldout"]


def test_data_cache_serves_a_smaller_run_and_options_must_match(tiny_target, draft, tmp_path):
    cached = load_batches(draft / "checkpoint" / "data", "train")
    assert sum(e.answer_len for b in cached for e in b) >= 150
    with pytest.raises(ValueError, match="--hidden was 32, now 48"):
        distill(settings(tiny_target, draft, hidden=48), log=lambda _: None)
    with pytest.raises(ValueError, match="--seed was 3, now 4"):
        distill(settings(tiny_target, draft, seed=4), log=lambda _: None)


def test_the_target_answers_in_the_dtype_asked_and_the_cache_keeps_to_it(tiny_target, tmp_path):
    out, quiet = tmp_path / "bf16", lambda _: None
    bf16 = settings(tiny_target, out, teacher_dtype="bfloat16", stop_after=0)
    assert distill(bf16, quiet) is None
    (first, *_), *_ = load_batches(out / "checkpoint" / "data", "train")
    engine = Engine.load(EngineConfig(str(tiny_target), dtype="bfloat16", max_sessions=1))
    prompt = first.ids[: first.prompt_len]
    again = Teacher(engine, load_tokenizer(tiny_target)).examples(
        [prompt], [first.answer_len], k=1
    )[0]
    assert again.ids == first.ids  # the bfloat16 engine's own greedy answer
    with pytest.raises(ValueError, match="--teacher-dtype was 'bfloat16', now 'float32'"):
        distill(settings(tiny_target, out, stop_after=0), quiet)
    recipe = out / "checkpoint" / "recipe.json"  # written before the option existed:
    old = json.loads(recipe.read_text())
    del old["teacher_dtype"]
    recipe.write_text(json.dumps(old))
    with pytest.raises(ValueError, match="--teacher-dtype was 'float32', now 'bfloat16'"):
        distill(bf16, quiet)


def test_draft_bench_rows_all_give_the_target_tokens(tiny_target, draft):
    table = draft_bench.run(
        draft_bench.DraftBenchSettings(
            target_model=str(tiny_target), draft_model=str(draft), prompts=2, max_tokens=8
        )
    )
    check_draft_bench_table(table)


def check_draft_bench_table(table: str) -> None:
    """Both held-out sets have agreement figures and tokens per target forward; every decoder
    row gave the target's tokens on both."""
    lines = table.splitlines()
    sets = [line.split(" | ") for line in lines if line.startswith(("| heldout |", "| unlike |"))]
    assert [row[0] for row in sets] == ["| heldout", "| unlike"]
    for row in sets:  # positions, top-1, top-3, rounds, in the loop
        assert int(row[1]) > 0 and int(row[4]) > 0
        assert all(0 <= float(cell.strip("*| ")) <= 1 for cell in (row[2], row[3], row[5]))
    rows = lines[lines.index(next(line for line in lines if line.startswith("| decoder |"))) :]
    assert rows[0].endswith("| (b) tokens per target forward | (b) on unlike | same tokens |")
    rows = [line for line in rows[2:] if line.startswith("| ")]
    assert len(rows) == 7 and all(row.endswith("| yes |") for row in rows)
    for row in rows:  # tokens per target forward on both sets: the bonus token at least
        assert all(float(cell) >= 1.0 for cell in row.split(" | ")[3:5])
    assert "draft/target **" in table
