"""The bench's concurrent streams over real HTTP: one queue of requests, N running at once."""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from tests.gateway.helpers import LiveGateway
from workers.tools.bench.serving import run_streams

FAST_ONES = 3  # the requests that must run while the slow one waits


def held_server() -> FastAPI:
    """A chat endpoint whose "slow" request answers only once FAST_ONES other requests
    have arrived meanwhile ("released"), or after 5 s without them ("timed out")."""
    app = FastAPI()
    arrived = {"fast": 0}

    @app.post("/v1/chat/completions")
    async def chat(body: dict) -> StreamingResponse:
        if body["messages"][0]["content"] == "slow":
            for _ in range(500):
                if arrived["fast"] >= FAST_ONES:
                    break
                await asyncio.sleep(0.01)
            answer = "released" if arrived["fast"] >= FAST_ONES else "timed out"
        else:
            arrived["fast"] += 1
            answer = "fast"

        async def events():
            yield f"data: {json.dumps({'choices': [{'delta': {'content': answer}}]})}\n\n"
            usage = {"choices": [], "usage": {"completion_tokens": 1}}
            yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_a_stream_takes_the_next_request_while_another_is_slow():
    # 2 streams, 4 requests: with a fixed share each (0 and 2, 1 and 3) the slow request 0
    # would hold request 2 back, and only two fast requests could run while it waits
    conversations = [[{"role": "user", "content": c}] for c in ("slow", "fast", "fast", "fast")]
    with LiveGateway(held_server()) as server:
        timings, wall = asyncio.run(run_streams(server.url, conversations, 2, 2, 8, len))
    assert [t.text for t in timings] == ["released", "fast", "fast", "fast"]
    assert [t.key for t in timings] == [0, 1, 2, 3]  # in request order
    assert all(t.tokens == 1 for t in timings) and wall > 0
