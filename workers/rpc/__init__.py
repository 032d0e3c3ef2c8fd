"""gRPC plumbing shared by the draft and target workers and their clients.

convert        the one place that maps protobuf messages to the runner dataclasses
errors         exceptions <-> status codes (the server interceptor and the client)
batcher        the engine thread and the cross-session batching queue
metrics        the per-worker Prometheus registry
server         a running worker: grpc.aio server, health, metrics, reaper, shutdown
client         DraftClient / TargetClient over grpc.aio channels, check_pair
remote         the speculation loop over the two clients (propose, verify, commit)
bench_workers  target worker throughput at 1, 4 and 8 sessions (python -m, not a test)
"""
