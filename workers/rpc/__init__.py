"""gRPC plumbing of the draft and target workers and their clients.

convert        the one place that maps protobuf messages to workers.protocol's dataclasses
status         worker errors <-> status codes (the server interceptor and the client)
batcher        the engine thread and the cross-session batching queue
metrics        the per-worker Prometheus registry
service        the one servicer for both roles and serve_role(), which starts a worker
server         a running worker: grpc.aio server, health, metrics, reaper, shutdown
client         GrpcBackend: one worker over a grpc.aio channel, as a workers.protocol Backend
"""
