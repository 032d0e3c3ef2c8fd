"""S sessions decode-stepping through a TargetRunner (bfloat16, the embedded model): tokens a
second with lookups in every row (lookup_rows 4096; "all": up to 3 a step, "all1": 1)
against none ("off"), 48 forwards from the prefill, and where the time goes:
`python runner-rows.py 16 grounded off,all,all1 [alternations, 2]` from the repository root. Since
2026-11-29 02:45 UTC also "cheap" (the engine's cheap rows only, up to 3 a step) and "long"
(those, and past them steps whose history agrees with its latest match over 6 tokens:
the runner's defaults); the first three modes pass long_match 0, as the runner was before."""

import sys
import time

from workers.engine.engine import Engine, EngineConfig
from workers.engine.sessions import SessionTable
from workers.engine.text import encode_chat
from workers.protocol import UNFINISHED, VerifyCall
from workers.settings import EMBEDDED_MODEL
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree
from workers.target.runner import LONG_MATCH, TargetRunner
from workers.tools.bench.workloads import messages

SESSIONS, WORKLOAD, MODES = int(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
FORWARDS = 48
# mode -> (the runner's lookup_rows (None: the engine's), each call's lookup, long_match)
SETTINGS = {
    "off": (0, 0, 0),
    "all": (4096, 3, 0),
    "all1": (4096, 1, 0),
    "cheap": (None, 3, 0),
    "long": (None, 3, LONG_MATCH),
}

engine = Engine.load(EngineConfig(EMBEDDED_MODEL, dtype="bfloat16", max_sessions=SESSIONS))
engine.torch_beside_kernel()
prompts = [encode_chat(engine.tokenizer, m) for m in messages(WORKLOAD, SESSIONS)]
forward_s = [0.0]
untimed = engine.run


def timed(rows):
    start = time.perf_counter()
    out = untimed(rows)
    forward_s[0] += time.perf_counter() - start
    return out


engine.run = timed


def stepped(session: int, held: int, lookup: int) -> VerifyCall:
    most = 16 if lookup else 0
    return VerifyCall(
        f"s{session}", held, [], TokenTree.empty(), SamplingParams(), steps=8, lookup=lookup,
        most=most,
    )  # fmt: skip


def run(lookup_rows: int | None, lookup: int, long: int) -> tuple[float, float, float, int, int]:
    table = SessionTable(SESSIONS)
    runner = TargetRunner(engine, table, lookup_rows=lookup_rows, long_match=long)
    starts = [
        VerifyCall(f"s{i}", 0, p, TokenTree.empty(), SamplingParams())
        for i, p in enumerate(prompts)
    ]
    outs = runner.verify(starts)  # the prefill
    held = [len(p) + len(o.emitted) for p, o in zip(prompts, outs, strict=True)]
    calls = [stepped(i, held[i], lookup) for i in range(SESSIONS)]
    forward_s[0], first, made, nodes, accepted = 0.0, runner.forwards, 0, 0, 0
    start = time.perf_counter()
    while runner.forwards - first < FORWARDS:
        for i, out in enumerate(runner.verify(calls)):
            if out is UNFINISHED:
                continue
            made += len(out.emitted)
            held[i] += len(out.emitted)
            nodes += out.lookup_nodes
            accepted += len(out.lookup_accepted)
            calls[i] = stepped(i, held[i], lookup)
    wall = time.perf_counter() - start
    for i in range(SESSIONS):
        runner.end(f"s{i}")
    return made / wall, wall, forward_s[0], nodes, accepted


for _ in range(int(sys.argv[4]) if len(sys.argv) > 4 else 2):
    for mode in MODES:
        tps, wall, fw, nodes, accepted = run(*SETTINGS[mode])
        print(
            f"{mode:6s} tok/s={tps:6.1f} wall={wall:5.2f}s forward={fw:5.2f}s "
            f"other={wall - fw:5.2f}s forwards={FORWARDS} ms/fwd={1000 * fw / FORWARDS:5.1f} "
            f"other/fwd={1000 * (wall - fw) / FORWARDS:4.1f} nodes={nodes} acc={accepted}",
            flush=True,
        )
