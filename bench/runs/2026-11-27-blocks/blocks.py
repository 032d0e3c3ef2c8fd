"""What a forward of the embedded model costs around 16 and 32 rows on the AMX tile unit:
the bfloat16 kernel's products alone (`linear`), one forward of decode rows behind 300
cached tokens (`forward`), and the target runner's verify of 16 sessions with a few draft
nodes beside them (`runner`). Quartiles of interleaved repeats (this VM's speed moves).

Usage, from a clone of the commit measured:
`PYTHONPATH=$PWD python blocks.py linear|forward|runner`.
"""

import sys
import time

import torch

from workers.engine.batch import SlotInput
from workers.engine.bf16_linear import bf16_kernel
from workers.engine.engine import Engine, EngineConfig
from workers.engine.loader import default_cache_dir
from workers.engine.sessions import SessionTable
from workers.protocol import VerifyCall
from workers.settings import EMBEDDED_MODEL
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree
from workers.target.runner import TargetRunner

PREFIX = 300
FORWARD_ROWS = (12, 14, 15, 16, 17, 18, 20, 24, 28, 31, 32, 33, 34)


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


def linear() -> None:
    kernel = bf16_kernel(torch.bfloat16, torch.device("cpu"), default_cache_dir(), 2, True)
    torch.set_num_threads(1)
    print("AMX", kernel.amx, "threads", kernel.threads)
    shapes = {
        "gate_up": (576, 3072),
        "down": (1536, 576),
        "qkv": (576, 960),
        "lm_head": (576, 49152),
    }
    for name, (k, n) in shapes.items():
        panels = kernel.pack(torch.randn(n, k).to(torch.bfloat16))
        cells = []
        for rows in (8, 16, 17, 24, 32, 33):
            x = torch.randn(rows, k).to(torch.bfloat16)
            timed(lambda x=x, p=panels, n=n: kernel.linear(x, p, None, n), 5)
            times = timed(lambda x=x, p=panels, n=n: kernel.linear(x, p, None, n), 30)
            cells.append(f"{rows}: {1000 * quartile(times):.0f}")
        print(f"{name} {k}->{n}, us at rows", ", ".join(cells))


def engine(sessions: int) -> Engine:
    config = EngineConfig(
        EMBEDDED_MODEL, dtype="bfloat16", max_sessions=sessions, attention="compiled"
    )
    loaded = Engine.load(config)
    loaded.torch_beside_kernel()
    return loaded


def forward(sessions: int = 40, counts: tuple[int, ...] = FORWARD_ROWS) -> None:
    model = engine(sessions)
    ids = [(7 * i + 11) % model.vocab_size for i in range(PREFIX)]
    times: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(8):
        for n in counts:
            rows = [SlotInput(slot, PREFIX, [-1], ids[slot : slot + 1], 1) for slot in range(n)]
            model.forward(rows)
            times[n] += timed(lambda rows=rows: model.forward(rows), 6)
    for n in counts:
        print(f"{n:3} decode rows: {quartile(times[n]):6.2f} ms")


def runner(sessions: int = 16, more: dict[str, list[int]] | None = None) -> None:
    """`sessions` decode rows alone, then with draft nodes beside them: the kinds below and
    `more` (a kind's name -> the nodes of each session that drafts)."""
    target = TargetRunner(engine(sessions), SessionTable(sessions), row_block=1)  # nothing cut
    greedy = SamplingParams()
    prompts = {f"s{i}": [(7 * j + 11 * i) % 49152 for j in range(PREFIX)] for i in range(sessions)}
    held = {}
    first = [VerifyCall(s, 0, p, TokenTree.empty(), greedy) for s, p in prompts.items()]
    for call, outcome in zip(first, target.verify(first), strict=True):
        held[call.session_id] = PREFIX + len(outcome.emitted)
    kinds = {f"{sessions} rows": [], "1 of them with 1 node": [1], "2 with 1 node": [1, 1]}
    kinds |= {"1 with 2 nodes": [2], "4 with 1 node": [1] * 4} | (more or {})
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


if __name__ == "__main__":
    {"linear": linear, "forward": forward, "runner": runner}[sys.argv[1]]()
