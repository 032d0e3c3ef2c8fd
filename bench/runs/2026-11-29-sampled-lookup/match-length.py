"""How often a decode step's lookup is right, by the length of the suffix it matched: the
target's greedy answers to the bench's 16 grounded and 24 chat prompts (64 tokens, float32,
the in-process loop), and at every position whose last 3 tokens occurred before, the best
3-token chain of the lookup (`ngram_tree(min_ngram=3)`, as the target worker drafts it)
against what the target said next, bucketed by how far back the latest match agrees:
`python match-length.py` from the repository root."""

from collections import defaultdict

from workers.engine.engine import EngineConfig
from workers.engine.text import encode_chat
from workers.loop.inprocess import build_local
from workers.protocol import TreeSpec
from workers.settings import EMBEDDED_MODEL
from workers.speculation.ngram import MAX_NGRAM, SuffixIndex, ngram_tree
from workers.speculation.sampling import SamplingParams
from workers.tools.bench.ceiling import accepted
from workers.tools.bench.workloads import messages

BUCKETS = (3, 4, 6, 8, 12, 16, 32)  # a match of L tokens falls in the largest bucket <= L
LONGEST = 64


def matched(index: SuffixIndex, end: int) -> int:
    """How many tokens before the history's end agree with those up to `end`."""
    tokens, size, n = index.tokens, len(index.tokens), 0
    while n < LONGEST and end - n >= 0 and tokens[end - n] == tokens[size - 1 - n]:
        n += 1
    return n


decoder, engine = build_local(
    EngineConfig(model=EMBEDDED_MODEL), "ngram", TreeSpec(depth=16, branching=2, budget=16)
)
for workload, n in (("grounded", 16), ("chat", 24)):
    counts = defaultdict(lambda: [0, 0, 0, 0])  # bucket -> positions, first, second, third
    positions = 0
    for conversation in messages(workload, n):
        prompt = encode_chat(engine.tokenizer, conversation)
        output = decoder.generate(prompt, 64, SamplingParams()).token_ids
        index = SuffixIndex()
        index.extend(prompt)
        for at in range(len(output)):
            positions += 1
            length, ends = index.matches(min_ngram=MAX_NGRAM)
            if length == MAX_NGRAM:
                chain = ngram_tree(index, min_ngram=MAX_NGRAM, depth=3, budget=3, chain=True)
                got = accepted(chain, output[at:])
                bucket = max(b for b in BUCKETS if b <= matched(index, ends[0]))
                row = counts[bucket]
                row[0] += 1
                for k in range(3):
                    row[k + 1] += got > k
            index.extend(output[at : at + 1])
    print(f"{workload}: {positions} positions")
    for bucket in sorted(counts):
        n0, n1, n2, n3 = counts[bucket]
        print(
            f"  match >= {bucket:2d}: {n0:4d} positions, first accepted {n1 / n0:.2f}, "
            f"second after the first {n2 / max(n1, 1):.2f}, third after the second "
            f"{n3 / max(n2, 1):.2f}"
        )
