"""The OpenAI endpoints through the real `openai` client, over tiny in-process workers."""

from __future__ import annotations

import httpx
import pytest
import torch
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM

from tests.gateway.helpers import MODEL, live, model_draft, target, word_tokenizer

CHAT = [{"role": "user", "content": "hello world , the cat"}]


@pytest.fixture(scope="module")
def server(tiny_dir):
    """One target and the in-gateway n-gram draft."""
    with live(tiny_dir, [target(tiny_dir)]) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def hf_greedy_text(model_dir, messages, max_new_tokens: int) -> str:
    tokenizer = word_tokenizer()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.eos_token_id,
        )
    return tokenizer.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True)


def chat_stream(client, **kw) -> tuple[list, str]:
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return chunks, text


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_greedy_equals_transformers(client, tiny_dir):
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == hf_greedy_text(tiny_dir, CHAT, 24)
    assert choice.finish_reason in ("stop", "length")
    assert reply.id.startswith("chatcmpl-") and reply.model == MODEL and reply.created > 0
    assert reply.usage.completion_tokens <= 24
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_stream_equals_non_stream(client):
    kw = dict(messages=CHAT, max_tokens=24, temperature=0)
    full = client.chat.completions.create(model=MODEL, **kw).choices[0].message.content
    chunks, text = chat_stream(client, stream_options={"include_usage": True}, **kw)
    assert text == full
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_include_usage_has_no_usage_chunk(client):
    chunks, _ = chat_stream(client, messages=CHAT, max_tokens=5, temperature=0)
    assert all(c.choices for c in chunks)


def test_text_parts_and_system_messages(client):
    messages = [
        {"role": "system", "content": "the dog"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": " world"}],
        },
        {"role": "assistant", "content": "one two"},
        {"role": "user", "content": "three"},
    ]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert reply.usage.prompt_tokens > 10


def test_completions_prompt_forms(client):
    tokenizer = word_tokenizer()
    ids = tokenizer("the cat sat")["input_ids"]
    by_text = client.completions.create(
        model=MODEL, prompt="the cat sat", max_tokens=8, temperature=0
    )
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    batch = client.completions.create(
        model=MODEL, prompt=["the cat sat", "a dog ran"], max_tokens=8, temperature=0
    )
    assert by_text.object == "text_completion"
    assert by_text.choices[0].text == by_ids.choices[0].text == batch.choices[0].text
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.usage.prompt_tokens == len(ids) + len(tokenizer("a dog ran")["input_ids"])


def test_completions_echo_and_logprobs(client):
    echo = client.completions.create(
        model=MODEL, prompt="the cat", max_tokens=6, temperature=0, echo=True
    )
    plain = client.completions.create(
        model=MODEL, prompt="the cat", max_tokens=6, temperature=0, logprobs=2
    )
    assert echo.choices[0].text == "the cat" + plain.choices[0].text
    lp = plain.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert len(lp.tokens) == plain.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    # greedy: each token is its position's most likely one
    assert all(
        max(top.values()) == pytest.approx(v)
        for top, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )


def test_completions_stream_with_echo(client):
    full = client.completions.create(
        model=MODEL, prompt="the cat", max_tokens=6, temperature=0, echo=True
    )
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="the cat", max_tokens=6, temperature=0, echo=True, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_chat_logprobs(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in content)
    chunks, _ = chat_stream(client, messages=CHAT, max_tokens=6, temperature=0, logprobs=True)
    streamed = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert [t.token for t in streamed] == [t.token for t in content]


def test_n_choices(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=10, temperature=1.0, n=2, seed=5
    )
    assert [c.index for c in reply.choices] == [0, 1]
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=10, temperature=1.0, n=2, seed=5, stream=True
        )
    )
    streamed = ["", ""]
    for c in chunks:
        for choice in c.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == [c.message.content for c in reply.choices]
    assert {c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason}


def test_same_seed_same_text(client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=16, temperature=1.0, top_p=0.95)
    a = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    others = {
        client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in range(4)
    }
    assert a == b
    assert len(others) > 1  # the seed matters


def test_top_k_extra_body(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=8, temperature=1.0, seed=3, extra_body={"top_k": 1}
    )
    greedy = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content == greedy.choices[0].message.content


def test_stop_strings_including_one_spanning_rounds(client):
    kw = dict(messages=CHAT, max_tokens=30, temperature=0)
    chunks, text = chat_stream(client, **kw)
    pieces = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert len(pieces) >= 3, "the prompt should need several rounds"
    # a stop string made of the end of one streamed piece and the start of the next
    boundary = len(pieces[0]) + len(pieces[1])
    stop = text[boundary - 2 : boundary + 2]
    expected = text[: text.find(stop)]
    for stream in (False, True):
        if stream:
            got_chunks, got = chat_stream(client, stop=[stop, "zzz"], **kw)
            assert all(
                stop not in (c.choices[0].delta.content or "") for c in got_chunks if c.choices
            )
            finish = [c.choices[0].finish_reason for c in got_chunks if c.choices][-1]
        else:
            reply = client.chat.completions.create(model=MODEL, stop=stop, **kw)
            got, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
        assert got == expected
        assert finish == "stop"


def test_speculation_stats(client):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "one two three one two three one two three"}],
        max_tokens=20,
        temperature=0,
        extra_body={"speculation_stats": True},
    )
    stats = reply.model_extra["speculation_stats"]
    assert stats["verify_steps"] >= 1
    assert stats["accepted_tokens"] <= stats["draft_tokens"]
    assert stats["emitted_tokens"] >= reply.usage.completion_tokens
    chunks, _ = chat_stream(
        client, messages=CHAT, max_tokens=8, temperature=0, extra_body={"speculation_stats": True}
    )
    assert chunks[-1].choices == [] and "speculation_stats" in chunks[-1].model_extra


def test_health_and_metrics(server, client):
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    text = httpx.get(server.url + "/metrics").text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }

    def total(name: str, **labels) -> float:
        """The sum over the series of `name` whose labels include `labels`."""
        wanted = set(labels.items())
        return sum(v for (n, have), v in samples.items() if n == name and wanted <= set(have))

    assert total("specsplit_requests_total", endpoint="chat", status="200") >= 1
    assert total("specsplit_time_to_first_token_seconds_count") >= 1
    assert total("specsplit_verify_steps_total") >= 1
    assert total("specsplit_draft_tokens_total") >= total("specsplit_accepted_tokens_total") > 0
    assert total("specsplit_worker_up", address="t0", role="target") == 1
    assert total("specsplit_round_phase_seconds_count", phase="verify") >= 1


def test_model_draft_worker_is_lossless(tiny_dir, tiny_draft_dir):
    with live(tiny_dir, [target(tiny_dir), model_draft(tiny_draft_dir)]) as gateway:
        client = OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=24,
            temperature=0,
            extra_body={"speculation_stats": True},
        )
        assert reply.choices[0].message.content == hf_greedy_text(tiny_dir, CHAT, 24)
        stats = reply.model_extra["speculation_stats"]
        assert stats["accepted_tokens"] > 0 and stats["degraded_rounds"] == 0
