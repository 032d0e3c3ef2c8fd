"""Where one served round's time goes, Verify as stream messages against unary calls: the
client's call, the worker's Verify handler and the runner's step timestamped by wrappers (a
tiny target served over localhost gRPC in this process, one session, 200 tokens, three turns
each). PYTHONPATH=. python bench/runs/2026-11-27-streams/round_split.py"""

# ruff: noqa
import asyncio, sys, time, torch, statistics, functools
from tests.engine.tiny import tiny_hf_model
from workers.engine.engine import Engine, EngineConfig
from workers.loop import Plan
from workers.speculation.sampling import SamplingParams
from workers.tools.bench.workers import served_rows
import workers.rpc.client as client, workers.rpc.stream as stream, workers.rpc.service as service, workers.rpc.batcher as batcher, workers.target.runner as runner

torch.set_num_threads(1)
T = {}
log = []
now = time.perf_counter_ns
oc = client.GrpcBackend.call


async def call(self, method, request, calls=1):
    T["c0"] = now()
    r = await oc(self, method, request, calls)
    T["c1"] = now()
    if method == "Verify":
        log.append(dict(T))
    return r


client.GrpcBackend.call = call
osend = stream.CallStream.send


async def send(self, batch):
    T["c0"] = now()
    r = await osend(self, batch)
    T["c1"] = now()
    log.append(dict(T))
    return r


stream.CallStream.send = send
ov = service.WorkerServicer.Verify


async def Verify(self, request, context):
    T["s0"] = now()
    r = await ov(self, request, context)
    T["s1"] = now()
    return r


service.WorkerServicer.Verify = Verify
ors = runner.TargetRunner.verify


def rv(self, calls):
    T["r0"] = now()
    r = ors(self, calls)
    T["r1"] = now()
    return r


runner.TargetRunner.verify = rv
eng = Engine.from_hf(
    tiny_hf_model(),
    None,
    EngineConfig(model="tiny", max_sessions=4, max_seq_len=512),
    model_id="tiny",
)
gen = torch.Generator().manual_seed(1)
prompt = torch.randint(0, 96, (32,), generator=gen).tolist()
plain = client.GrpcBackend.__init__
for rep in range(3):
    for streaming in (False, True):
        client.GrpcBackend.__init__ = functools.partialmethod(plain, streaming=streaming)
        log.clear()
        rows = asyncio.run(
            served_rows(
                eng, [Plan(prompt, 200, SamplingParams())], [1], draft=False, batch_wait_ms=2.0
            )
        )
        L = log[20:]
        med = lambda a, b: statistics.median((t[b] - t[a]) / 1e3 for t in L)
        print(
            f"streaming={streaming!s:5} {rows[0].seconds / rows[0].tokens * 1e3:.3f} ms/token; to worker {med('c0', 's0'):.0f} us, runner {med('r0', 'r1'):.0f}, back {med('s1', 'c1'):.0f}, call {med('c0', 'c1'):.0f}",
            flush=True,
        )
