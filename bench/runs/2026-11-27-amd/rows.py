"""What a draft node costs the target beside 8 or 16 decode rows on a CPU without AMX: one
forward of N decode rows behind 300 cached tokens (`forward`), and the target runner's
verify of 8 or 16 sessions with a few draft nodes beside them (`runner`). Lower quartiles
of interleaved repeats (this VM's speed moves).

Usage, from a clone of the commit measured: `PYTHONPATH=$PWD python rows.py forward|runner`.
"""

import sys
import time

from workers.engine.batch import SlotInput
from workers.engine.engine import Engine, EngineConfig
from workers.engine.sessions import SessionTable
from workers.protocol import VerifyCall
from workers.settings import EMBEDDED_MODEL
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree
from workers.target.runner import TargetRunner

PREFIX = 300


def quartile(times: list[float]) -> float:
    """The lower quartile, in ms: the VM's slow moments fall above it."""
    return 1000 * sorted(times)[len(times) // 4]


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def engine(sessions: int) -> Engine:
    config = EngineConfig(
        EMBEDDED_MODEL, dtype="bfloat16", max_sessions=sessions, attention="compiled"
    )
    loaded = Engine.load(config)
    loaded.torch_beside_kernel()
    print("row block", loaded.row_block)
    return loaded


def forward() -> None:
    model = engine(24)
    ids = [(7 * i + 11) % model.vocab_size for i in range(PREFIX)]
    counts = [1, 2, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14, 16, 17, 18, 20, 24]
    times: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(8):
        for n in counts:
            rows = [SlotInput(slot, PREFIX, [-1], ids[slot : slot + 1], 1) for slot in range(n)]
            model.forward(rows)
            times[n] += timed(lambda rows=rows: model.forward(rows), 6)
    for n in counts:
        print(f"{n:3} decode rows: {quartile(times[n]):6.2f} ms")


def runner_at(sessions: int) -> None:
    target = TargetRunner(engine(sessions), SessionTable(sessions), row_block=1)
    greedy = SamplingParams()
    prompts = {f"s{i}": [(7 * j + 11 * i) % 49152 for j in range(PREFIX)] for i in range(sessions)}
    held = {}
    first = [VerifyCall(s, 0, p, TokenTree.empty(), greedy) for s, p in prompts.items()]
    for call, outcome in zip(first, target.verify(first), strict=True):
        held[call.session_id] = PREFIX + len(outcome.emitted)
    kinds = {f"{sessions} rows": [], "1 of them with 1 node": [1], "2 with 1 node": [1, 1]}
    kinds |= {"1 with 2 nodes": [2], "4 with 1 node": [1] * 4, "1 with 4 nodes": [4]}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(6):
        for kind, nodes in kinds.items():
            for step in range(6):
                trees = [TokenTree.chain([5] * n) for n in nodes]
                trees += [TokenTree.empty()] * (sessions - len(trees))
                calls = [
                    VerifyCall(s, held[s], [], t, greedy) for s, t in zip(held, trees, strict=True)
                ]
                start = time.perf_counter()
                outcomes = target.verify(calls)
                if step:
                    times[kind].append(time.perf_counter() - start)
                for call, outcome in zip(calls, outcomes, strict=True):
                    held[call.session_id] += len(outcome.emitted)
    for kind, measured in times.items():
        print(f"{kind:22} {quartile(measured):6.2f} ms")


def runner() -> None:
    for sessions in (8, 16):
        runner_at(sessions)


if __name__ == "__main__":
    {"forward": forward, "runner": runner}[sys.argv[1]]()
