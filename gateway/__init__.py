"""The OpenAI-compatible gateway: HTTP in, the speculation loop over worker pools out.

One file per concern, in the order a request meets them:

    app.py          create_app(settings, backend_factory): lifespan, middleware, routes
    routes.py       handlers that only dispatch; API-key check
    schemas.py      request bodies; unsupported parameters refused by name
    errors.py       the OpenAI error shape for every failure
    service.py      Gateway: shared state on app.state, one method per endpoint
    admission.py    the admission queue: requests beyond capacity wait in line (FIFO)
    prompts.py      chat template / prompts -> token ids; limits and context checks
    generation.py   the one generator of deltas (all choices of a request)
    speculation.py  one choice's run of the loop (workers.loop) over the pools: routing,
                    failover, adaptive trees, the look-ahead and metrics as the loop's hooks
    adaptive.py     each round's tree sized to the session's acceptance and the target's load
    overlap.py      the look-ahead's state: draft round k+1 while k is verified
    text.py         incremental detokenizer, stop strings (both hold text back)
    responses.py    deltas -> stream chunks (SSE) or one collected response
    pool.py         worker pools (health, DNS), the router (least loaded, affinity)
    metrics.py      Prometheus metrics on the app's own registry; PromQL
    settings.py     GatewaySettings (flags = SPECSPLIT_ environment variables)
    main.py         `specsplit gateway`
    serve.py        `specsplit serve`: workers as child processes + the gateway

The n-gram draft runs inside the gateway by default: prompt lookup needs only
the history the gateway already owns, so a draft worker would add a network
hop per round and a process to deploy for microseconds of work. Model drafts
run in draft workers (`--draft-addresses`).

Workers are reached through workers.protocol's Backend: over gRPC
(workers.rpc.client.GrpcBackend) or in this process (workers.loop.inprocess,
for the n-gram draft and the tests).
"""
