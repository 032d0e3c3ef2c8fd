"""One forward's cost on the native engine, for the shapes a serving round feeds.

`forward_costs` times Engine.forward (the target's whole forward: embedding,
blocks, the logits the round needs) for four shapes, behind a cached prefix
of PREFIX tokens: one decode token, a 17-node draft tree (16 nodes and the
root), 8 sessions of one token each, and a 130-token prompt prefill. The
cache content is whatever it holds: the timing does not depend on it.
"""

from __future__ import annotations

import statistics
import time

from workers.engine.batch import SlotInput
from workers.engine.engine import Engine

PREFIX = 130  # committed tokens behind each decode row (a chat prompt's length)
TREE = [-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]  # (17,): the root and 16 nodes


def shapes(vocab: int) -> dict[str, list[SlotInput]]:
    """The rows of each timed forward (token ids are arbitrary in-vocabulary ones)."""
    ids = [(7 * i + 11) % vocab for i in range(PREFIX)]
    return {
        "1 token": [SlotInput(0, PREFIX, [-1], ids[:1])],
        "17-token tree": [SlotInput(0, PREFIX, TREE, ids[: len(TREE)], len(TREE))],
        "8 x 1 token": [SlotInput(slot, PREFIX, [-1], ids[slot : slot + 1]) for slot in range(8)],
        "130-token prefill": [SlotInput(0, 0, list(range(-1, PREFIX - 1)), ids)],
    }


def forward_costs(engine: Engine, reps: int = 20) -> dict[str, float]:
    """Median milliseconds of one forward per shape (the engine needs 8 slots)."""
    out = {}
    for name, rows in shapes(engine.vocab_size).items():
        for _ in range(3):  # warm-up (and any compilation)
            engine.forward(rows)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            engine.forward(rows)
            times.append(time.perf_counter() - start)
        out[name] = 1000 * statistics.median(times)
    return out
