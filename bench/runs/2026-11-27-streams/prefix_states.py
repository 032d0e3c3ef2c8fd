"""A feature session's first verify with a shared system prompt: the target (SmolLM2-135M,
bfloat16) prefills it whole when no states of the prefix are kept, and only past the
prefix when another feature session left them (workers/target/states.py). Each request
is a fresh session on one runner; the first warms the prefix, the rest are timed, with
the state budget at its default and at zero (no states kept: the old behaviour). Then a
conversation's second turn: the first turn answers 128 tokens in decode rounds, and the
second turn (a new session on the whole history and a new question) is timed.

    PYTHONPATH=. python bench/runs/2026-11-27-streams/prefix_states.py [SYSTEM_WORDS]
"""

import statistics
import sys
import time

import torch

from workers.engine.engine import Engine, EngineConfig
from workers.engine.sessions import SessionTable
from workers.engine.text import encode_chat
from workers.protocol import VerifyCall
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree
from workers.target.runner import TargetRunner


def main() -> None:
    words = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    torch.set_num_threads(1)
    config = EngineConfig(model="smollm2-135m-instruct", max_sessions=8, dtype="bfloat16")
    engine = Engine.load(config)
    system = "You are a careful assistant. " + " ".join(f"rule{i}" for i in range(words))
    questions = [f"What is {i} times {i + 3}?" for i in range(7)]
    prompts = [
        encode_chat(engine.tokenizer, [{"role": "system", "content": system},
                                       {"role": "user", "content": q}])
        for q in questions
    ]  # fmt: skip
    print(f"prompts of {len(prompts[0])} tokens", flush=True)
    for budget in (0, 64 << 20, 0, 64 << 20):
        runner = TargetRunner(engine, SessionTable(engine.num_slots), state_bytes=budget)
        times, hits = [], []
        for i, prompt in enumerate(prompts):
            call = VerifyCall(f"s{budget}-{i}", 0, prompt, TokenTree.empty(), SamplingParams(),
                              return_hidden=True)  # fmt: skip
            start = time.perf_counter()
            (out,) = runner.verify([call])
            if i:
                times.append(time.perf_counter() - start)
                hits.append(out.prefix_hit)
            runner.end(call.session_id)
        ms = statistics.median(times) * 1e3
        print(f"state budget {budget >> 20} MiB: first verify {ms:.1f} ms, hits {hits}", flush=True)
        second_turn(engine, runner, prompts[0], f"t{budget}")


def second_turn(engine: Engine, runner: TargetRunner, prompt: list[int], name: str) -> None:
    greedy = SamplingParams()
    first = VerifyCall(name + "-1", 0, prompt, TokenTree.empty(), greedy, return_hidden=True)
    history = prompt + runner.verify([first])[0].emitted
    while len(history) < len(prompt) + 128:
        step = VerifyCall(name + "-1", len(history), [], TokenTree.empty(), greedy,
                          return_hidden=True)  # fmt: skip
        history += runner.verify([step])[0].emitted
    runner.end(name + "-1")
    turn = history + engine.tokenizer.encode("And what about the next one?")
    call = VerifyCall(name + "-2", 0, turn, TokenTree.empty(), greedy, return_hidden=True)
    start = time.perf_counter()
    (out,) = runner.verify([call])
    ms = (time.perf_counter() - start) * 1e3
    print(f"  second turn of {len(turn)} tokens: first verify {ms:.1f} ms, hit {out.prefix_hit}")
    runner.end(call.session_id)


if __name__ == "__main__":
    main()
