"""SIGTERM to a real `specsplit serve` mid-stream: the stream finishes whole, readiness and
new requests get 503 with Retry-After while it does, and serve exits 0 once drained."""

from __future__ import annotations

import signal

import httpx
import pytest
from openai import OpenAI

from tests.gateway.helpers import wait_until
from tests.gateway.test_serve import MODEL, STORY, Serve, alive, stream_text


@pytest.mark.embedded
def test_sigterm_drains_every_stream_before_exiting(tmp_path):
    server = Serve(tmp_path, "--drain-timeout-s", "60")
    server.wait_ready()
    url = server.state["url"]
    root = url.removesuffix("/v1")
    client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    kw = dict(messages=STORY, max_tokens=96, temperature=0)
    clean = stream_text(client, **kw)
    during: dict[str, httpx.Response] = {}

    def terminate_mid_stream(i: int) -> None:
        if i != 3 or during:
            return
        server.process.send_signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(f"{root}/health").status_code == 503, 10, "readiness 503")
        during["health"] = httpx.get(f"{root}/health")
        body = {"model": MODEL, "messages": STORY, "max_tokens": 4}
        during["new"] = httpx.post(f"{url}/chat/completions", json=body)

    try:
        drained = stream_text(client, on_chunk=terminate_mid_stream, **kw)
    finally:
        code = server.process.wait(90)
    assert drained == clean  # nothing cut, nothing changed
    assert during["health"].json()["status"] == "draining"
    refused = during["new"]
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "shutting_down"
    assert code == 0
    for worker in server.state["workers"]:  # stopped only after the gateway drained
        wait_until(lambda pid=worker["pid"]: not alive(pid), 30, "the workers to exit")
