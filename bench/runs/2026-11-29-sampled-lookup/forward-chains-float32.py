"""One bfloat16 forward of S sessions each feeding a chain of d draft tokens (and its root)
behind 300 cached tokens: `python forward-chains.py` from the repository root."""

import statistics
import time

from workers.engine.batch import SlotInput
from workers.engine.engine import Engine, EngineConfig
from workers.tools.bench.engine import EngineBenchSettings

PREFIX = 300

engine = Engine.load(
    EngineConfig(EngineBenchSettings().target_model, dtype="float32", max_sessions=32)
)
engine.torch_beside_kernel()  # as a worker runs it: the kernel on every thread, torch on one
vocab = engine.vocab_size


def rows(sessions: int, depth: int) -> list[SlotInput]:
    parents = list(range(-1, depth))  # (depth + 1,): the root, then a chain
    return [
        SlotInput(
            slot,
            PREFIX,
            parents,
            [(7 * slot + 3 * i + 11) % vocab for i in range(depth + 1)],
            depth + 1,
        )
        for slot in range(sessions)
    ]


for sessions in (1, 2, 4, 6, 8):
    for depth in (0, 1, 3):
        batch = rows(sessions, depth)
        for _ in range(3):
            engine.forward(batch)
        times = []
        for _ in range(25):
            start = time.perf_counter()
            engine.forward(batch)
            times.append(time.perf_counter() - start)
        ms = 1000 * statistics.median(times)
        print(f"S={sessions} d={depth} fed={sessions * (depth + 1)} ms={ms:.1f}", flush=True)
