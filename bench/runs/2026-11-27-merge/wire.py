"""Client CPU a step when a step's 12 calls travel as K messages of one VerifyStream (an echo
server in a child process; workers.rpc.stream.CallStream on the client).

Usage: `PYTHONPATH=$PWD python wire.py`.
"""

import asyncio
import subprocess
import sys
import time

import grpc

from proto.specsplit.v1 import specsplit_pb2 as pb
from proto.specsplit.v1 import specsplit_pb2_grpc as rpc
from workers.rpc.stream import CallStream

PORT = 50777


class Echo(rpc.TargetServiceServicer):
    async def VerifyStream(self, requests, context):
        async for request in requests:
            response = pb.VerifyBatchResponse(tag=request.tag)
            for _ in request.calls:
                response.results.add()
            await context.write(response)


async def serve() -> None:
    server = grpc.aio.server()
    rpc.add_TargetServiceServicer_to_server(Echo(), server)
    server.add_insecure_port(f"127.0.0.1:{PORT}")
    await server.start()
    await server.wait_for_termination()


def call(i: int) -> pb.VerifyRequest:
    return pb.VerifyRequest(session_id=f"s{i}", base_len=300, tokens=[1234])


async def client(k: int, steps: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{PORT}") as channel:
        stream = CallStream(rpc.TargetServiceStub(channel).VerifyStream, None)
        per = 12 // k

        async def step() -> None:
            batches = [pb.VerifyBatchRequest(calls=[call(j) for j in range(per)]) for _ in range(k)]
            await asyncio.gather(*(stream.send(batch) for batch in batches))

        for _ in range(50):
            await step()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            await step()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        print(
            f"k={k:2} messages/step: client CPU {1000 * cpu / steps:.3f} ms/step "
            f"({1000 * cpu / steps / k:.3f} ms/message), wall {1000 * wall / steps:.3f} ms/step"
        )
        await stream.close()


def main() -> None:
    if sys.argv[1:] == ["serve"]:
        asyncio.run(serve())
        return
    server = subprocess.Popen([sys.executable, __file__, "serve"])
    time.sleep(2)
    try:
        for k in [1, 2, 6, 12, 1, 6]:
            asyncio.run(client(k, 400))
    finally:
        server.kill()


if __name__ == "__main__":
    main()
