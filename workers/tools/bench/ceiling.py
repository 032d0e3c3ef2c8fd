"""`specsplit bench ceiling`: how far n-gram trees can beat n-gram chains, by replay.

Greedy decoding is deterministic, so the accepted length of any n-gram draft
at any point of a text follows from the text alone: the draft is accepted as
far as it agrees with the target's greedy continuation. This tool decodes the
benchmark prompts once (SpecSplit, greedy: the target's own tokens), then
replays every round with n-gram drafts of several shapes and reports tau (tokens
per target forward, the bonus token included) for each:

  - chain:      the best single continuation, `budget` tokens long;
  - tree:       the n-gram tree with the same node budget (what SpecSplit sends);
  - all matches: a tree of every continuation of every earlier match of the
    last two tokens, 4,096 nodes at most: what any tree built from the
    history could reach, an upper bound on tree / chain.

It also reports, for every position of the outputs (the chat set's too), how
long a suffix the n-gram lookup matched there and how much of its best chain
the target accepted: a long match predicts a copied run far better than a
short one (bench/RESULTS.md, "Shadow drafts and acceptance per match
length").

No timing is involved, so the figures do not depend on the machine's load.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings

from workers.settings import EMBEDDED_MODEL, settings_config
from workers.speculation.ngram import MAX_NGRAM, SuffixIndex, ngram_tree
from workers.speculation.tree import TokenTree
from workers.tools.bench.report import publish
from workers.tools.bench.workloads import messages


class CeilingSettings(BaseSettings):
    model_config = settings_config("bench ceiling")

    target_model: str = Field(EMBEDDED_MODEL, description="the target model")
    prompts: int = Field(8, ge=1, description="input-grounded prompts")
    humaneval: int = Field(16, ge=1, le=164, description="HumanEval problems (the first N)")
    chat: int = Field(24, ge=0, description="open-ended chat prompts (acceptance by match only)")
    max_tokens: int = Field(96, ge=1, description="most new tokens per prompt")
    budgets: str = Field("4,8,16", description="comma list of node budgets")
    out: Path = Field(Path("bench/results"), description="where ceiling.md goes")


def accepted(tree: TokenTree, truth: list[int]) -> int:
    """Draft tokens accepted: the longest root path that agrees with `truth`."""
    children: dict[int, dict[int, int]] = {}
    for node, (token, parent) in enumerate(
        zip(tree.tokens.tolist(), tree.parents.tolist(), strict=True)
    ):
        children.setdefault(parent, {}).setdefault(token, node)
    at, n = -1, 0
    while n < len(truth) and truth[n] in children.get(at, {}):
        at = children[at][truth[n]]
        n += 1
    return n


def replay_tau(texts: list[tuple[list[int], list[int]]], draft) -> float:
    """Tokens per round when each round emits the accepted draft plus the bonus token.

    texts: (prompt, greedy output) pairs; draft(history) -> TokenTree, the history as a
    SuffixIndex."""
    rounds = emitted = 0
    for prompt, output in texts:
        history, at = SuffixIndex(), 0
        history.extend(prompt)
        while at < len(output):
            step = min(accepted(draft(history), output[at:]) + 1, len(output) - at)
            history.extend(output[at : at + step])
            at += step
            rounds += 1
            emitted += step
    return emitted / rounds


def by_match(texts: list[tuple[list[int], list[int]]], depth: int) -> list[tuple[int, int, int]]:
    """Per match length n (0..MAX_NGRAM): (positions, positions whose chain's first token
    was accepted, chain tokens accepted), the best chain `depth` deep drafted at every
    position of every output."""
    counts = [[0, 0, 0] for _ in range(MAX_NGRAM + 1)]
    for prompt, output in texts:
        history = SuffixIndex()
        history.extend(prompt)
        for at in range(len(output)):
            tree = ngram_tree(history, depth=depth, budget=depth, chain=True)
            n, got = history.match_length(), accepted(tree, output[at:])
            history.extend(output[at : at + 1])
            counts[n][0] += 1
            counts[n][1] += got > 0
            counts[n][2] += got
    return [(a, b, c) for a, b, c in counts]


def shapes(budget: int) -> dict[str, dict]:
    return {
        "chain": {"depth": budget, "budget": budget, "chain": True},
        "tree": {"depth": 16, "budget": budget},
    }


ALL_MATCHES = {"max_ngram": 2, "depth": 16, "budget": 4096, "max_matches": 64}
MATCH_DEPTH = 6  # the default tree's depth


def greedy_texts(s: CeilingSettings) -> dict[str, list[tuple[list[int], list[int]]]]:
    from workers.engine.engine import EngineConfig
    from workers.engine.text import encode_chat
    from workers.loop.inprocess import build_local
    from workers.protocol import TreeSpec
    from workers.speculation.sampling import SamplingParams

    decoder, engine = build_local(
        EngineConfig(model=s.target_model), "ngram", TreeSpec(depth=16, branching=2, budget=16)
    )
    texts = {}
    for workload, n in (("grounded", s.prompts), ("humaneval", s.humaneval), ("chat", s.chat)):
        if not n:
            continue
        pairs = []
        for conversation in messages(workload, n):
            prompt = encode_chat(engine.tokenizer, conversation)
            generation = decoder.generate(prompt, s.max_tokens, SamplingParams())
            pairs.append((prompt, generation.token_ids))
        texts[workload] = pairs
    return texts


def run_ceiling(s: CeilingSettings) -> str:
    texts = greedy_texts(s)
    budgets = [int(b) for b in s.budgets.split(",") if b.strip()]
    lines = [
        f"n-gram tau by replay: {s.target_model}, {s.prompts} input-grounded prompts, "
        f"{s.humaneval} HumanEval problems and {s.chat} chat prompts, {s.max_tokens} greedy "
        "tokens each.",
        "",
        "| workload | budget | chain τ | tree τ | tree / chain | all matches τ | "
        "all matches / chain |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for workload, pairs in texts.items():
        if workload == "chat":  # open-ended: no copy to bound
            continue
        ceiling = replay_tau(pairs, lambda h: ngram_tree(h, **ALL_MATCHES))
        for budget in budgets:
            tau = {
                name: replay_tau(pairs, lambda h, kw=kw: ngram_tree(h, **kw))
                for name, kw in shapes(budget).items()
            }
            chain = tau["chain"]
            lines.append(
                f"| {workload} | {budget} | {chain:.2f} | {tau['tree']:.2f} | "
                f"{tau['tree'] / chain:.2f}× | {ceiling:.2f} | {ceiling / chain:.2f}× |"
            )
    lines += [
        "",
        f"By the length of the suffix the lookup matched: every position of the outputs, "
        f"the best chain {MATCH_DEPTH} deep (0: no match, nothing to draft).",
        "",
        "| workload | match | positions | first token accepted | tokens accepted per chain |",
        "|---|---:|---:|---:|---:|",
    ]
    for workload, pairs in texts.items():
        for n, (positions, first, tokens) in enumerate(by_match(pairs, MATCH_DEPTH)):
            if positions:
                lines.append(
                    f"| {workload} | {n} | {positions} | {first / positions:.2f} | "
                    f"{tokens / positions:.2f} |"
                )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    from workers.settings import parse

    s = parse(CeilingSettings, argv)
    table = run_ceiling(s)
    publish(table, s.out, "ceiling.md")
