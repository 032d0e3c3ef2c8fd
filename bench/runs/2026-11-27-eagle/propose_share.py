"""The drafter's share of a round in the loop (bench/DRAFT.md, "Twice the steps").

PYTHONPATH=CHECKOUT python propose_share.py HEAD_DIR [PREFILL_CHUNK [PASSES]]: the
in-process loop of that checkout over the bfloat16 target and a feature draft, tree 3/2/6,
4 unlike prompts, 64 tokens, the target prefilling in chunks of PREFILL_CHUNK tokens (0 =
whole prompts), PASSES passes (3); prints tokens/s, ms a round, ms the drafter's propose
took a round, tokens a round. Without PYTHONPATH, Python puts this script's folder first
and imports the installed checkout, whichever folder the command runs in.
"""

import dataclasses
import sys
import time

import torch

from workers.draft.features import model_drafter
from workers.engine.engine import Engine, EngineConfig
from workers.engine.sessions import SessionTable
from workers.engine.text import encode_chat, stop_token_ids
from workers.loop.inprocess import LocalDecoder
from workers.protocol import TreeSpec
from workers.speculation.sampling import SamplingParams
from workers.target.runner import TargetRunner
from workers.tools.distill import prompts

torch.set_num_threads(1)
config = EngineConfig(
    model="smollm2-135m-instruct", max_sessions=2, max_seq_len=1024, dtype="bfloat16",
    kernel_threads=2,
)  # fmt: skip
target = Engine.load(config)
head = Engine.load(dataclasses.replace(config, model=sys.argv[1]))
chats = [
    encode_chat(target.tokenizer, [{"role": "user", "content": text}])
    for text in prompts.take("unlike", 1, 4)
]
drafter = model_drafter(head, SessionTable(2))
spent = [0.0, 0]  # seconds in propose, calls
propose = drafter.propose


def timed(calls):
    start = time.perf_counter()
    trees = propose(calls)
    spent[0] += time.perf_counter() - start
    spent[1] += 1
    return trees


drafter.propose = timed
spec = TreeSpec(depth=3, branching=2, budget=6)
chunk = int(sys.argv[2]) if len(sys.argv) > 2 else 0
runner = TargetRunner(target, SessionTable(2), prefill_chunk=chunk or None)
decoder = LocalDecoder(runner, drafter, spec, stop_token_ids(target.tokenizer))
decoder.generate(chats[0][:24], 4, SamplingParams())
for _ in range(int(sys.argv[3]) if len(sys.argv) > 3 else 3):
    spent[:] = [0.0, 0]
    start, tokens, rounds = time.perf_counter(), 0, 0
    for ids in chats:
        out = decoder.generate(ids, 64, SamplingParams())
        tokens, rounds = tokens + len(out.token_ids), rounds + out.stats.verify_steps
    seconds = time.perf_counter() - start
    print(
        f"{tokens / seconds:.1f} tok/s, round {seconds / rounds * 1e3:.1f} ms, "
        f"propose {spent[0] / spent[1] * 1e3:.2f} ms, {tokens / rounds:.2f} tok/round"
    )
