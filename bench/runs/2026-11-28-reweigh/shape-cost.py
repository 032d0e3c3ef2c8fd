"""The gateway's own work a round for an n-gram session's tree (`Speculation.shape`), in µs.

Sixteen sessions with the grounded workload's prompts (`specsplit bench paired --workload
grounded`) and decode steps of 4 each run 60 rounds of four tokens each against a target
whose cost fit reads a = 28 ms, b = 0.9 ms a token fed (about what a forward of 32 decode
rows costs here) and the listed alpha for every kind: at 32 or 16 sessions no draft pays (at
alpha 0.3 the bound `can_pay` already says so; at 0.5 and 16 sessions every shape is
weighed to find it), at 1 session every round drafts. Prints the median over the sessions.

    PYTHONPATH=. .venv/bin/python bench/runs/2026-11-28-reweigh/shape-cost.py \
        ~/.cache/specsplit/models/smollm2-135m-instruct
"""

import random
import statistics
import sys
import time
from types import SimpleNamespace

from transformers import AutoTokenizer

from gateway.adaptive import CostFit
from tests.gateway.test_adaptive import CONFIG, SPEC, rates, session
from workers.tools.bench.workloads import messages

ROUNDS = 60


def prompt_ids(tokenizer, conversation) -> list[int]:
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def per_round_us(prompt: list[int], rate: float, load: int) -> tuple[float, int]:
    """µs a round of `Speculation.shape` and the rounds that drafted."""
    speculation = session(rates(rate), tuple(prompt), ngram=True, steps=4)
    fit = CostFit()
    for n in [32, 96, 64, 160] * 10:
        fit.observe(n, 0.028 + 0.0009 * n, CONFIG)
        fit.observe_gaps(0.010, 0.012, CONFIG)
    speculation.target.worker = SimpleNamespace(cost=fit, load=load, max_tree_nodes=64)
    speculation.unaccepted = 100  # no draft accepted lately: rounds of steps
    pick = random.Random(0)
    drafted = 0
    start = time.perf_counter()
    for _ in range(ROUNDS):
        drafted += speculation.shape(SPEC) is not None
        speculation.quiet = max(0, speculation.quiet - 1)  # as `observe` does
        speculation.history.extend(pick.sample(prompt, 4))
        speculation.target.held = len(speculation.history)
    return (time.perf_counter() - start) / ROUNDS * 1e6, drafted


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    prompts = [prompt_ids(tokenizer, c) for c in messages("grounded", 16)]
    print(f"prompts: median {statistics.median(map(len, prompts))} tokens")
    for rate, load in ((0.3, 32), (0.5, 16), (0.5, 1)):
        runs = [per_round_us(p, rate, load) for p in prompts]
        us = statistics.median(r[0] for r in runs)
        drafted = statistics.median(r[1] for r in runs)
        print(f"alpha {rate}, {load} sessions: {us:.1f} µs a round, {drafted:.0f} of {ROUNDS}")


if __name__ == "__main__":
    main()
