"""The suffix cache through the gateway: lossless, and a tenant drafts only from its own outputs."""

from __future__ import annotations

from openai import OpenAI

from tests.gateway.helpers import MODEL, live, target
from tests.gateway.test_api import CHAT, hf_greedy_text
from workers.draft.suffix import tenant_of

MAX_TOKENS = 24


def ask(url: str, key: str) -> tuple[str, dict]:
    client = OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"speculation_stats": True},
    )
    return reply.choices[0].message.content, reply.model_extra["speculation_stats"]


def test_cached_outputs_draft_for_their_tenant_only_and_change_no_token(tiny_dir):
    # fixed trees: each round's tree depends only on what the drafter finds
    kw = dict(api_keys="key-a,key-b", adaptive_tree=False, suffix_cache_tokens=1024)
    with live(tiny_dir, [target(tiny_dir)], **kw) as gateway:
        a1, first = ask(gateway.url, "key-a")
        a2, again = ask(gateway.url, "key-a")  # drafts from a1's output
        b1, other = ask(gateway.url, "key-b")  # must draft as if nothing were cached
        cache = gateway.gateway.generator.suffixes
    assert a1 == a2 == b1 == hf_greedy_text(tiny_dir, CHAT, MAX_TOKENS)
    assert again["accepted_tokens"] > first["accepted_tokens"]
    assert again["verify_steps"] < first["verify_steps"]
    assert {k: other[k] for k in first} == first
    assert set(cache.tenants) == {tenant_of("key-a"), tenant_of("key-b")}


def test_the_cache_is_off_at_zero_tokens(tiny_dir):
    with live(tiny_dir, [target(tiny_dir)], suffix_cache_tokens=0) as gateway:
        assert gateway.gateway.generator.suffixes is None
