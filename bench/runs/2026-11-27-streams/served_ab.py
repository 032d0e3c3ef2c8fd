"""Served per-token time on a tiny random target (a forward well under a millisecond): a
target worker (and with `draft`, an n-gram draft worker) served over localhost gRPC in this
process, the round's calls as stream messages against unary calls, taking turns.

    PYTHONPATH=. python bench/runs/2026-11-27-streams/served_ab.py [REPEATS] [draft]
"""

import asyncio
import functools
import statistics
import sys

import torch

import workers.rpc.client as client
from tests.engine.tiny import tiny_hf_model
from workers.engine.engine import Engine, EngineConfig
from workers.loop import Plan
from workers.speculation.sampling import SamplingParams
from workers.tools.bench.workers import served_rows

SESSIONS = [1, 8]


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    draft = sys.argv[2:] == ["draft"]
    torch.set_num_threads(1)
    config = EngineConfig(model="tiny", max_sessions=8, max_seq_len=512)
    engine = Engine.from_hf(tiny_hf_model(), None, config, model_id="tiny")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (32,), generator=gen).tolist() for _ in range(8)]
    plans = [Plan(prompt, 200, SamplingParams()) for prompt in prompts]
    plain = client.GrpcBackend.__init__
    ms: dict[tuple[bool, int], list[float]] = {}
    outputs: dict[int, list] = {}
    for _ in range(repeats):
        for streaming in (False, True):
            client.GrpcBackend.__init__ = functools.partialmethod(plain, streaming=streaming)
            rows = asyncio.run(served_rows(engine, plans, SESSIONS, draft, batch_wait_ms=2.0))
            for row in rows:
                ms.setdefault((streaming, row.sessions), []).append(row.seconds / row.tokens * 1e3)
                assert outputs.setdefault(row.sessions, row.outputs) == row.outputs
            said = ", ".join(
                f"{r.sessions}: {r.seconds / r.tokens * 1e3:.3f} ms/token" for r in rows
            )
            print(f"streaming={streaming}: {said}", flush=True)
    for n in SESSIONS:
        calls, stream = statistics.median(ms[(False, n)]), statistics.median(ms[(True, n)])
        print(
            f"{n} sessions: calls {calls:.3f}, stream {stream:.3f} ms/token, {calls / stream:.2f}x"
        )


if __name__ == "__main__":
    main()
