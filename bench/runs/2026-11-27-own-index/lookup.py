"""µs the gateway spends on its own n-gram draft, in process: a session's first drafted
round after a prompt of 300 or 1,500 random tokens (vocabulary 300), then rounds that grow
2 tokens each, two ways taking turns:

- drafter: the in-process NgramDrafter's propose (its SessionTable takes the history, its
  own SuffixIndex indexes it) on top of the loop's index, which the gateway keeps anyway
  for each round's match length;
- own index: the tree looked up in the loop's index (what Speculation.draft_tree does now).

Usage, from a clone of the commit measured: `PYTHONPATH=$PWD python lookup.py`.
"""

import random
import time

from workers.draft.ngram import NgramDrafter, lookup_tree
from workers.engine.sessions import SessionTable
from workers.protocol import ProposeCall, TreeSpec
from workers.speculation.ngram import SuffixIndex

SPEC = TreeSpec(depth=4, budget=8)


def run(text: list[int], prompt_len: int, drafter: NgramDrafter | None) -> tuple[float, float]:
    """(µs of the first drafted round, µs a round after it), the loop's index included."""
    index, held = SuffixIndex(), 0

    def round_(upto: int) -> None:
        nonlocal held
        index.extend(text[len(index) : upto])  # the loop's own, for the match length
        if drafter is None:
            lookup_tree(index, SPEC, None, None, 1)
        else:
            drafter.propose([ProposeCall("s", held, text[held:upto], SPEC)])
            held = upto

    start = time.perf_counter()
    round_(prompt_len)
    first = time.perf_counter() - start
    start, rounds, size = time.perf_counter(), 0, prompt_len
    while size + 2 <= len(text):
        size, rounds = size + 2, rounds + 1
        round_(size)
    return 1e6 * first, 1e6 * (time.perf_counter() - start) / rounds


def main() -> None:
    random.seed(0)
    for prompt_len in (300, 1500):
        text = [random.randrange(300) for _ in range(prompt_len + 400)]
        for turn in range(3):
            for name in ("drafter", "own index"):
                drafter = NgramDrafter(SessionTable(4)) if name == "drafter" else None
                first, after = run(text, prompt_len, drafter)
                figures = f"first {first:7.1f} µs, then {after:5.1f} µs a round"
                print(f"{prompt_len} {turn} {name:9} {figures}")


if __name__ == "__main__":
    main()
