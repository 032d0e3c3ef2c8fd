"""S sessions decode-stepping through a TargetRunner (bf16, embedded model): tokens/s with
lookups in every row (lookup_rows 4096; "all": up to 3 a step, "all1": 1) against none
("off"), 48 forwards from the prefill, and where the time goes:
`python runner-rows.py 16 grounded off,all,all1` from the repository root."""
import sys, time, statistics
from workers.engine.engine import Engine, EngineConfig
from workers.engine.sessions import SessionTable
from workers.engine.text import encode_chat
from workers.protocol import UNFINISHED, VerifyCall
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree
from workers.target.runner import TargetRunner
from workers.tools.bench.workloads import messages
from workers.settings import EMBEDDED_MODEL

S = int(sys.argv[1]); workload = sys.argv[2]; modes = sys.argv[3].split(",")
engine = Engine.load(EngineConfig(EMBEDDED_MODEL, dtype="bfloat16", max_sessions=S))
engine.torch_beside_kernel()
prompts = [encode_chat(engine.tokenizer, m) for m in messages(workload, S)]
fwd = [0.0]
orig = engine.run
def timed(rows):
    t = time.perf_counter(); out = orig(rows); fwd[0] += time.perf_counter() - t; return out
engine.run = timed

def run(lookup_rows, lookup):
    runner = TargetRunner(engine, SessionTable(S), lookup_rows=lookup_rows)
    calls = [VerifyCall(f"s{i}", 0, p, TokenTree.empty(), SamplingParams()) for i, p in enumerate(prompts)]
    outs = runner.verify(calls)  # prefill
    held = [len(p) + len(o.emitted) for p, o in zip(prompts, outs)]
    total = [len(o.emitted) for o in outs]
    fwd[0] = 0.0; forwards0 = runner.forwards
    calls = {i: VerifyCall(f"s{i}", held[i], [], TokenTree.empty(), SamplingParams(), steps=8, lookup=lookup, most=16 if lookup else 0) for i in range(S)}
    t0 = time.perf_counter(); made = 0; nodes = acc = 0
    while runner.forwards - forwards0 < 48:
        live = list(range(S))
        outs = runner.verify([calls[i] for i in live])
        for i, o in zip(live, outs):
            if o is UNFINISHED: continue
            total[i] += len(o.emitted); made += len(o.emitted); held[i] += len(o.emitted)
            nodes += o.lookup_nodes; acc += len(o.lookup_accepted)
            calls[i] = VerifyCall(f"s{i}", held[i], [], TokenTree.empty(), SamplingParams(), steps=8, lookup=lookup, most=16 if lookup else 0)
    wall = time.perf_counter() - t0
    for i in range(S): runner.end(f"s{i}")
    f = runner.forwards - forwards0
    return made / wall, wall, fwd[0], f, nodes, acc

for rep in range(2):
    for mode in modes:
        name, lr, lk = {"off": ("off", 0, 0), "cheap": ("cheap", None, 3),
                        "all": ("all", 4096, 3), "all1": ("all1", 4096, 1)}[mode]
        tps, wall, fw, f, nodes, acc = run(lr, lk)
        print(f"{name:6s} tok/s={tps:6.1f} wall={wall:5.2f}s forward={fw:5.2f}s other={wall-fw:5.2f}s forwards={f} ms/fwd={1000*fw/f:5.1f} other/fwd={1000*(wall-fw)/f:4.1f} nodes={nodes} acc={acc}", flush=True)
