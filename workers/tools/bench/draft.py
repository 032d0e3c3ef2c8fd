"""`specsplit bench draft`: a distilled draft's figures on a chat workload (bench/DRAFT.md).

`specsplit bench draft [--draft-model smollm2-135m-draft] [--prompts 8]` measures, greedy,
on each of distillation's two held-out sets (`heldout`: topics and passages of the training
kinds the draft never saw; `unlike`: prompt kinds it never trained on,
workers/tools/distill/prompts.py):
  (a) top-1 / top-3 agreement of the draft with the target's greedy token, teacher-forced
      on the target's own answers, and the share of one-token chains the target accepts
      in the loop (per-token acceptance, the draft fed what the loop commits);
and on the `heldout` set:
  (b) tokens per target forward (accepted draft tokens + the bonus token) with a tree (on
      the `unlike` set too, untimed, where the draft's deeper levels stand on its weaker
      first);
  (c) the cost of one forward of 1 token behind a KV cache, draft over target, both on
      SpecSplit's native engine (medians, interleaved so load changes hit both alike);
  (d) tokens/s of the in-process loop (LocalDecoder) with speculation off, the n-gram
      draft and the model draft (with the default tree, a smaller tree and a chain),
      prompt by prompt in turn, checking that all give the same tokens.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field
from pydantic_settings import BaseSettings

from workers.draft.features import model_drafter
from workers.draft.ngram import NgramDrafter
from workers.engine.batch import SlotInput
from workers.engine.engine import Engine, EngineConfig
from workers.engine.sessions import SessionTable
from workers.engine.text import encode_chat, stop_token_ids
from workers.loop.inprocess import LocalDecoder
from workers.protocol import TreeSpec
from workers.settings import EMBEDDED_MODEL, parse, settings_config
from workers.speculation.sampling import SamplingParams
from workers.target.runner import TargetRunner
from workers.tools.bench.machine import describe, load_words
from workers.tools.distill import prompts
from workers.tools.distill.data import HELD_OUT

TIMED = HELD_OUT[0]  # the held-out set of the tokens/s rows (new topics of the trained kinds)


class DraftBenchSettings(BaseSettings):
    model_config = settings_config("bench draft")

    target_model: str = Field(EMBEDDED_MODEL, description="the target")
    draft_model: str = Field("smollm2-135m-draft", description="the distilled draft")
    prompts: int = Field(8, ge=1, description="prompts of each held-out set")
    prompt_seed: int = Field(1, description="which held-out prompts")
    max_tokens: int = Field(64, ge=1, description="new tokens per prompt")
    tree_depth: int = Field(6, ge=1, description="tree of both drafts (TreeSpec() defaults)")
    tree_branching: int = Field(2, ge=1, description="children per expanded node")
    tree_budget: int = Field(16, ge=1, description="most tree nodes per round")
    small_depth: int = Field(3, ge=1, description="the smaller tree of the extra rows (and chain)")
    small_branching: int = Field(2, ge=1, description="its children per expanded node")
    small_budget: int = Field(6, ge=1, description="its most nodes per round")
    cost_repeats: int = Field(40, ge=1, description="timed 1-token forwards per model")
    threads: int = Field(0, ge=0, description="torch CPU threads; 0 = torch's default")
    dtype: Literal["float32", "bfloat16", "auto"] = Field(
        "float32", description="both models' dtype (auto as `specsplit serve --dtype auto`)"
    )
    out: Path | None = Field(None, description="Markdown file to write (default: print only)")


@torch.inference_mode()
def agreement(
    draft: Engine, target: Engine, prompt: list[int], answer: list[int]
) -> tuple[int, int, int]:
    """(top-1 hits, top-3 hits, positions): draft teacher-forced on prompt + answer; a
    feature draft also on the target's states (token t with the state after t - 1)."""
    fed = (prompt + answer)[:-1]  # each row predicts the token after it
    n = len(fed)
    row = SlotInput(0, 0, list(range(-1, n - 1)), fed, logits_for=n)
    features = None
    if draft.model.takes_features:
        states = target.run([row]).hidden[0]  # (n, E): after each fed token
        features = torch.cat([torch.zeros_like(states[:1]), states[:-1]])  # (n, E)
    guesses = draft.run([row], features).logits[0].topk(3, dim=-1).indices  # (n, 3)
    picked = guesses[len(prompt) - 1 :]  # rows predicting answer tokens
    truth = torch.tensor(answer)[:, None]
    return int((picked[:, :1] == truth).sum()), int((picked == truth).any(-1).sum()), len(answer)


def acceptance(
    chain: LocalDecoder,
    draft: Engine,
    target: Engine,
    chats: list[list[int]],
    answers: list[list[int]],
) -> dict:
    """(a) on one prompt set: teacher-forced top-1 / top-3 agreement with the target's greedy
    `answers`, and the share of one-token chains the target accepts in the loop."""
    hits1 = hits3 = positions = proposed = accepted = rounds = 0
    for ids, answer in zip(chats, answers, strict=True):
        h1, h3, n = agreement(draft, target, ids, answer)
        hits1, hits3, positions = hits1 + h1, hits3 + h3, positions + n
        gen = chain.generate(ids, len(answer), SamplingParams())
        if gen.token_ids != answer:
            raise RuntimeError("a one-token chain changed the target's greedy answer")
        proposed, accepted = proposed + gen.stats.draft_tokens, accepted + gen.stats.accepted_tokens
        rounds += gen.stats.verify_steps
    return {
        "positions": positions,
        "top1": hits1 / positions,
        "top3": hits3 / positions,
        "rounds": rounds,
        "loop": accepted / max(1, proposed),
    }


@torch.inference_mode()
def tokens_per_forward(
    decoder: LocalDecoder, chats: list[list[int]], answers: list[list[int]], max_tokens: int
) -> tuple[float, bool]:
    """(tokens per target forward, whether every answer was the target's greedy one) of
    `decoder` on `chats`, untimed."""
    emitted = steps = 0
    same = True
    for ids, answer in zip(chats, answers, strict=True):
        gen = decoder.generate(ids, max_tokens, SamplingParams())
        emitted, steps = emitted + gen.stats.emitted_tokens, steps + gen.stats.verify_steps
        same = same and gen.token_ids == answer
    return (emitted / steps if steps else 0.0), same


def forward_costs(engines: dict[str, Engine], sizes: dict[str, list[int]], repeats: int):
    """Median seconds of a forward of n new tokens (a chain) after a 64-token prefix.

    {name: {n: seconds}} for every engine and each n in sizes[name]; the timed calls of all
    engines are interleaved so that a change of machine load hits them alike.
    """
    times = {name: {n: [] for n in sizes[name]} for name in engines}
    for engine in engines.values():
        prefix = [(1000 + i) % engine.vocab_size for i in range(64)]
        fed(engine, SlotInput(0, 0, list(range(-1, 63)), prefix))
    for i in range(repeats):
        for name, engine in engines.items():
            token = (1100 + i) % engine.vocab_size
            for n in sizes[name]:  # n tokens at positions 64.., overwritten by the next call
                row = SlotInput(0, 64, list(range(-1, n - 1)), [token] * n)
                start = time.perf_counter()
                fed(engine, row)
                times[name][n].append(time.perf_counter() - start)
    return {name: {n: statistics.median(t) for n, t in ts.items()} for name, ts in times.items()}


def fed(engine: Engine, row: SlotInput) -> None:
    """One forward of `row`; a feature draft gets zero states (its cost is the same)."""
    states = None
    if engine.model.takes_features:
        states = torch.zeros(len(row.tokens), engine.model.shape.hidden_size)  # (T, E)
    engine.run([row], states)


def _shape(spec: TreeSpec) -> str:
    return f"{spec.depth}/{spec.branching}/{spec.budget}"


def run(s: DraftBenchSettings) -> str:
    if s.threads:
        torch.set_num_threads(s.threads)
    load_before = load_words()
    config = EngineConfig(model=s.target_model, max_sessions=2, max_seq_len=1024, dtype=s.dtype)
    target = Engine.load(config)
    draft = Engine.load(dataclasses.replace(config, model=s.draft_model))
    stops = stop_token_ids(target.tokenizer)
    tree = TreeSpec(depth=s.tree_depth, branching=s.tree_branching, budget=s.tree_budget)
    sets = {split: prompts.take(split, s.prompt_seed, s.prompts) for split in HELD_OUT}
    chats = {
        split: [encode_chat(target.tokenizer, [{"role": "user", "content": t}]) for t in texts]
        for split, texts in sets.items()
    }

    small = TreeSpec(depth=s.small_depth, branching=s.small_branching, budget=s.small_budget)
    chain = TreeSpec(depth=s.small_depth, branching=1, budget=s.small_depth)

    def decoder(drafter, spec: TreeSpec) -> LocalDecoder:
        return LocalDecoder(TargetRunner(target, SessionTable(2)), drafter, spec, stops)

    def ngram():
        return NgramDrafter(SessionTable(4))

    def model():
        return model_drafter(draft, SessionTable(2))

    decoders = {
        "speculation off": decoder(None, tree),
        f"n-gram draft, tree {_shape(tree)} (default)": decoder(ngram(), tree),
        f"model draft, tree {_shape(tree)} (default)": decoder(model(), tree),
        f"n-gram draft, tree {_shape(small)}": decoder(ngram(), small),
        f"model draft, tree {_shape(small)}": decoder(model(), small),
        f"n-gram draft, chain {_shape(chain)}": decoder(ngram(), chain),
        f"model draft, chain {_shape(chain)}": decoder(model(), chain),
    }
    for each in decoders.values():  # warm-up
        each.generate(chats[TIMED][0][:24], 4, SamplingParams())
    totals = {name: {"s": 0.0, "tokens": 0, "steps": 0, "emitted": 0} for name in decoders}
    outputs: dict[str, list[list[int]]] = {name: [] for name in decoders}
    for ids in chats[TIMED]:  # prompt by prompt, every decoder in turn
        for name, each in decoders.items():
            start = time.perf_counter()
            gen = each.generate(ids, s.max_tokens, SamplingParams())
            t = totals[name]
            t["s"] += time.perf_counter() - start
            t["tokens"] += len(gen.token_ids)
            t["steps"] += gen.stats.verify_steps
            t["emitted"] += gen.stats.emitted_tokens
            outputs[name].append(gen.token_ids)
    off = decoders["speculation off"]
    answers = {  # the target's greedy answers: the timed rows' own, then the other sets'
        split: outputs["speculation off"]
        if split == TIMED
        else [off.generate(ids, s.max_tokens, SamplingParams()).token_ids for ids in chats[split]]
        for split in chats
    }
    untimed = {  # (b) on the other sets: tokens per target forward, and the same tokens
        (name, split): tokens_per_forward(each, chats[split], answers[split], s.max_tokens)
        for name, each in decoders.items()
        if each is not off
        for split in chats
        if split != TIMED
    }
    one = decoder(model(), TreeSpec(depth=1, branching=1, budget=1))
    accepts = {
        split: acceptance(one, draft, target, chats[split], answers[split]) for split in chats
    }
    verify_sizes = sorted({1, 2, 4, 8, tree.budget + 1})
    costs = forward_costs(
        {"target": target, "draft": draft},
        {"target": verify_sizes, "draft": [1]},
        s.cost_repeats,
    )
    load_after = load_words()
    dtype = str(target.model.embed.weight.dtype).removeprefix("torch.")

    base = totals["speculation off"]["tokens"] / totals["speculation off"]["s"]
    others = [split for split in chats if split != TIMED]
    lines = [
        f"Draft benchmark: target `{s.target_model}`, draft `{s.draft_model}`, the first "
        f"{s.prompts} one-turn prompts of each held-out set (`prompts.take(SET, "
        f"{s.prompt_seed}, {s.prompts})`), {s.max_tokens} new tokens each, greedy. Trees are "
        f"written depth/branching/budget; {_shape(tree)} is `TreeSpec()`, the default.",
        f"Machine: {describe()}, {dtype}; load average before {load_before}, after {load_after}.",
        "",
        "(a) agreement with the target's greedy token: teacher-forced on the target's answers, "
        "and in the loop (a one-token chain every round: accepted / proposed)",
        "",
        "| held-out set | positions | top-1 | top-3 | rounds | in the loop |",
        "|---|---:|---:|---:|---:|---:|",
        *(
            f"| {split} | {a['positions']} | **{a['top1']:.3f}** | {a['top3']:.3f} | "
            f"{a['rounds']} | **{a['loop']:.3f}** |"
            for split, a in accepts.items()
        ),
        "",
        f"- (c) one forward of 1 token with a KV cache (native engine, median of "
        f"{s.cost_repeats}): target {costs['target'][1] * 1e3:.1f} ms, draft "
        f"{costs['draft'][1] * 1e3:.1f} ms: draft/target "
        f"**{costs['draft'][1] / costs['target'][1]:.3f}**",
        "- target forward of n tokens (what a verify of n - 1 tree nodes costs): "
        + ", ".join(f"{n}: {t * 1e3:.1f} ms" for n, t in costs["target"].items()),
        "",
        f"(b), (d) on the {TIMED} set, and (b) on the others ({', '.join(others)}):",
        "",
        "| decoder | tokens/s | × speculation off | (b) tokens per target forward | "
        + "".join(f"(b) on {split} | " for split in others)
        + "same tokens |",
        "|---|---:|---:|---:|" + "---:|" * len(others) + ":---:|",
    ]
    for name, t in totals.items():
        tps = t["tokens"] / t["s"]
        tau = t["emitted"] / t["steps"] if t["steps"] else 0.0
        rest = [untimed.get((name, split), (1.0, True)) for split in others]
        same = outputs[name] == answers[TIMED] and all(ok for _, ok in rest)
        cells = "".join(f"{other_tau:.2f} | " for other_tau, _ in rest)
        verdict = "yes" if same else "NO"
        lines.append(f"| {name} | {tps:.2f} | {tps / base:.2f} | {tau:.2f} | {cells}{verdict} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    s = parse(DraftBenchSettings, argv)
    table = run(s)
    print(table)
    if s.out is not None:
        s.out.parent.mkdir(parents=True, exist_ok=True)
        s.out.write_text(table + "\n")
