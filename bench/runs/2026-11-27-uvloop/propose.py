"""µs a propose of the n-gram drafter, in process, on one session that grows 2 tokens a
round after a prompt of 300 or 1,500 random tokens (vocabulary 300).

Usage, from a clone of the commit measured: `PYTHONPATH=$PWD python propose.py`.
"""

import random
import time

from workers.draft.ngram import NgramDrafter
from workers.engine.sessions import SessionTable
from workers.protocol import ProposeCall, TreeSpec


def main() -> None:
    random.seed(0)
    spec = TreeSpec(depth=4, budget=8)
    for prompt_len in (300, 1500):
        text = [random.randrange(300) for _ in range(prompt_len + 400)]
        drafter = NgramDrafter(SessionTable(4))
        held = prompt_len
        drafter.propose([ProposeCall("s", 0, text[:held], spec)])
        start, rounds = time.perf_counter(), 0
        while held + 2 <= len(text):
            drafter.propose([ProposeCall("s", held, text[held : held + 2], spec)])
            held, rounds = held + 2, rounds + 1
        print(prompt_len, f"{1e6 * (time.perf_counter() - start) / rounds:.1f} µs a propose")


if __name__ == "__main__":
    main()
