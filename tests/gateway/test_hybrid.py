"""Hybrid trees through the gateway and real gRPC workers: each round merges the gateway's
prompt lookup into the model draft's tree, and the text is still the target's."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from gateway.app import create_app
from tests.gateway.helpers import MODEL, LiveGateway, load_engine, sample, settings
from tests.workers.helpers import settings as worker_settings
from workers.rpc.service import serve_role

REPEATS = "one two three four five six one two three four five six one two three"
OPEN = "the cat sat on a red mat"
BOTH = 'specsplit_hybrid_rounds_total{parts="both"}'  # rounds that merged both drafts
# fixed trees, no suffix cache: each request drafts from its own history only
FIXED = dict(adaptive_tree=False, suffix_cache_tokens=0, tree_depth=4, tree_budget=10)


@contextlib.contextmanager
def grpc_workers(engines: dict[str, object], **overrides) -> Iterator[dict[str, str]]:
    """Real gRPC workers on localhost, one per role -> engine, served from their own
    event loop in a thread (`overrides`: their WorkerSettings'); yields role -> address."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(60)

    servers = {}
    try:
        for role, engine in engines.items():
            servers[role] = run(serve_role(role, engine, worker_settings(role, **overrides)))
        yield {role: f"127.0.0.1:{server.port}" for role, server in servers.items()}
    finally:
        for server in servers.values():
            run(server.shutdown(0))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def gateway(model_dir, addresses: dict[str, str], **kw) -> LiveGateway:
    """The gateway over those workers, dialled over gRPC (no in-process factory)."""
    drafts = [addresses["draft"]] if "draft" in addresses else []
    config = settings(model_dir, [addresses["target"]], drafts, insecure=True, **FIXED, **kw)
    return LiveGateway(create_app(config))


def client_of(live: LiveGateway) -> OpenAI:
    return OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)


def ask(client: OpenAI, prompt: str, **kw):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, **kw)


@pytest.fixture(scope="module")
def workers(tiny_dir, tiny_draft_dir) -> Iterator[dict[str, str]]:
    engines = {"target": load_engine(tiny_dir), "draft": load_engine(tiny_draft_dir)}
    with grpc_workers(engines) as addresses:
        yield addresses


@pytest.fixture(scope="module")
def plain(tiny_dir, workers) -> dict[str, str]:
    """Each prompt's greedy text from the target alone."""
    with gateway(tiny_dir, {"target": workers["target"]}, local_draft="none") as live:
        client = client_of(live)
        return {p: ask(client, p, temperature=0).choices[0].text for p in (REPEATS, OPEN)}


@pytest.fixture(scope="module")
def hybrid(tiny_dir, workers) -> Iterator[LiveGateway]:
    with gateway(tiny_dir, workers, hybrid_draft=True) as live:
        yield live


@pytest.mark.parametrize("prompt", [REPEATS, OPEN], ids=["repeats", "open"])
def test_hybrid_greedy_text_is_the_targets(hybrid, plain, prompt):
    reply = ask(client_of(hybrid), prompt, temperature=0, extra_body={"speculation_stats": True})
    assert reply.choices[0].text == plain[prompt]
    stats = reply.model_extra["speculation_stats"]
    assert stats["draft_tokens"] > 0 and stats["degraded_rounds"] == 0


def test_hybrid_rounds_merge_both_drafts(hybrid, plain):
    """Provenance names the hybrid drafter, and the metrics count rounds whose tree held
    n-gram and model nodes both (and rounds of n-gram nodes alone)."""
    stream = client_of(hybrid).completions.create(
        model=MODEL,
        prompt=REPEATS,
        max_tokens=40,
        temperature=0,
        stream=True,
        stream_options={"include_provenance": True},
    )
    text, rounds = "", []
    for chunk in stream:
        text += chunk.choices[0].text if chunk.choices else ""
        rounds += (chunk.model_extra.get("specsplit") or {}).get("rounds", [])
    assert text == plain[REPEATS]
    assert {r["drafter"] for r in rounds if r["tree_nodes"]} == {"hybrid"}
    metrics = httpx.get(hybrid.url + "/metrics").text
    assert sample(metrics, BOTH) > 0
    # rounds whose n-gram tree filled the budget: the draft worker was not asked
    assert sample(metrics, 'specsplit_hybrid_rounds_total{parts="ngram"}') > 0


def merged_rounds(live: LiveGateway) -> float:
    return sample(httpx.get(live.url + "/metrics").text, BOTH)


def test_hybrid_seeded_sample_is_a_valid_completion(hybrid):
    """Sampled: the n-gram nodes join the model's sampled tree as one-hot elder siblings
    (merge_trees' forest), through the target worker's recursive rejection."""
    client = client_of(hybrid)
    before = merged_rounds(hybrid)
    replies = [ask(client, REPEATS, temperature=0.8, seed=7) for _ in range(2)]
    first = replies[0].choices[0]
    assert first.text and first.finish_reason in ("stop", "length")
    assert replies[1].choices[0].text == first.text  # the same seed, the same text
    assert merged_rounds(hybrid) > before  # some of their rounds were merged trees
