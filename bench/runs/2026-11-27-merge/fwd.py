"""One bfloat16 forward of the embedded model (compiled attention, as a worker runs it) for
decode batches with and without short chains, behind 300 cached tokens a row: the marginal
cost of a drafted token in a batch. Usage: `PYTHONPATH=$PWD python fwd.py`."""

import statistics
import time

from workers.engine.batch import SlotInput
from workers.engine.engine import Engine, EngineConfig
from workers.settings import EMBEDDED_MODEL

PREFIX = 300


def rows(n: int, chains: list[int], ids: list[int]) -> list[SlotInput]:
    """`n` rows; the first ones feed a chain of chains[i] tokens, the rest one token."""
    out = []
    for slot in range(n):
        k = chains[slot] if slot < len(chains) else 1
        out.append(SlotInput(slot, PREFIX, list(range(-1, k - 1)), ids[slot : slot + k], k))
    return out


def main() -> None:
    config = EngineConfig(EMBEDDED_MODEL, dtype="bfloat16", max_sessions=16, attention="compiled")
    engine = Engine.load(config)
    engine.torch_beside_kernel()
    ids = [(7 * i + 11) % engine.vocab_size for i in range(PREFIX)]
    shapes = {
        "8x1": rows(8, [], ids),
        "8: 2 rows of 3": rows(8, [3, 3], ids),
        "8: 4 rows of 3": rows(8, [3] * 4, ids),
        "8x3": rows(8, [3] * 8, ids),
        "16x1": rows(16, [], ids),
        "16: 4 rows of 3": rows(16, [3] * 4, ids),
        "16x2": rows(16, [2] * 16, ids),
        "10x1": rows(10, [], ids),
        "12x1": rows(12, [], ids),
        "14x1": rows(14, [], ids),
    }
    for _ in range(2):
        for name, batch in shapes.items():
            for _ in range(3):
                engine.forward(batch)
            times = []
            for _ in range(15):
                start = time.perf_counter()
                engine.forward(batch)
                times.append(time.perf_counter() - start)
            tokens = sum(len(r.tokens) for r in batch)
            print(f"{name:16} tokens {tokens:3} {1000 * statistics.median(times):6.2f} ms")


if __name__ == "__main__":
    main()
