"""Every error is {"error": {"message", "type", "param", "code"}} with the right status."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai import OpenAI

from tests.gateway.helpers import MODEL, live, sample, target

CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(tiny_dir):
    with live(
        tiny_dir, [target(tiny_dir)], api_keys="key-1,key-2", max_n=4, max_body_bytes=4096
    ) as g:
        yield g


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="key-2", max_retries=0)


def post(server, path: str, content: bytes | str, key: str = "key-1") -> httpx.Response:
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    return httpx.post(server.url + path, content=content, headers=headers)


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_unknown_model_is_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-17", messages=CHAT)
    assert info.value.body["code"] == "model_not_found"
    assert info.value.body["param"] == "model"


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 5}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10_000}, "max_tokens"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -0.1}, "frequency_penalty"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"extra_body": {"mirostat_tau": 5.0}}, "mirostat_tau"),
        ({"extra_body": {"min_p": 1.5}}, "min_p"),
        ({"extra_body": {"cache_salt": ""}}, "cache_salt"),
        ({"extra_body": {"cache_salt": "s" * 1025}}, "cache_salt"),
        ({"extra_body": {"cache_salt": 7}}, "cache_salt"),
    ],
)
def test_bad_parameters_are_400_naming_the_parameter(client, kw, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT, **kw)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param
    assert info.value.body["type"] == "invalid_request_error"


def test_zero_penalties_are_accepted(client):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=2,
        presence_penalty=0,
        frequency_penalty=0.0,
        extra_body={"repetition_penalty": 1.0},
    )
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_identifying_fields_are_accepted(client):
    """OpenAI's prompt_cache_key (here the affinity key, as `user`) and safety_identifier."""
    reply = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=2,
        extra_body={"prompt_cache_key": "conversation-1", "safety_identifier": "user-hash"},
    )
    assert reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("raw", [b"{not json", b'{"model": 1}'])
@pytest.mark.parametrize("key", ["nope", None])
def test_a_request_without_a_valid_key_hears_401_before_its_body_is_judged(server, raw, key):
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    response = httpx.post(server.url + "/v1/chat/completions", content=raw, headers=headers)
    assert response.status_code == 401
    assert error_of(response)["code"] == "invalid_api_key"


def test_a_body_not_sent_as_json_names_the_content_type(server):
    """curl's -d alone sends a form's Content-Type, which FastAPI does not read as JSON."""
    body = json.dumps({"model": MODEL, "messages": CHAT})
    headers = {"authorization": "Bearer key-1", "content-type": "application/x-www-form-urlencoded"}
    response = httpx.post(server.url + "/v1/chat/completions", content=body, headers=headers)
    assert response.status_code == 400
    assert "Content-Type: application/json" in error_of(response)["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL}, "messages"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"messages": CHAT}, "model"),
        ({"model": MODEL, "messages": [{"role": "user"}], "max_tokens": "x"}, "max_tokens"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"model": MODEL, "messages": [{"role": "tool", "content": "1"}]}, "messages[0].role"),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            },
            "messages[0].content[0]",
        ),
        ({"model": MODEL, "messages": [{"role": "user"}]}, "messages[0].content"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text",
        ),
        (
            {"model": MODEL, "messages": [*CHAT, {"role": "assistant", "tool_calls": [{}]}]},
            "messages[1].tool_calls",
        ),
        (
            {"model": MODEL, "messages": [*CHAT, {"role": "assistant", "refusal": "no"}]},
            "messages[1].refusal",
        ),
        ({"model": MODEL, "messages": CHAT, "repetition_penalty": 1.2}, "repetition_penalty"),
        (
            {"model": MODEL, "messages": [*CHAT, {"role": "assistant", "content": "hi"}]}
            | {"continue_final_message": True},
            "continue_final_message",
        ),
        (
            {"model": MODEL, "messages": CHAT}
            | {"continue_final_message": True, "add_generation_prompt": False},
            "continue_final_message",
        ),
    ],
)
def test_validation_errors_are_400_with_param(server, body, param):
    response = post(server, "/v1/chat/completions", json.dumps(body))
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == param, error


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"text"'])
def test_bad_json_is_400(server, raw):
    response = post(server, "/v1/chat/completions", raw)
    assert response.status_code == 400
    assert error_of(response)["type"] == "invalid_request_error"


def test_missing_or_wrong_key_is_401(server):
    wrong = OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.models.list()
    assert info.value.body["code"] == "invalid_api_key"
    response = httpx.post(
        server.url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT}
    )
    assert response.status_code == 401
    assert error_of(response)["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # probes need no key
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_context_length_exceeded(client):
    long_prompt = "hello " * 200
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=100)
    assert info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hello " * 300)
    assert info.value.body["code"] == "context_length_exceeded"


def test_completion_specific_refusals(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="the", echo=True, logprobs=1)
    assert info.value.body["param"] == "echo"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="the", suffix="x")
    assert info.value.body["param"] == "suffix"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[5, 10_000])
    assert info.value.body["param"] == "prompt[0]"


def test_body_over_the_limit_is_413(server):
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a" * 5000}]})
    response = post(server, "/v1/chat/completions", big)
    assert response.status_code == 413
    assert error_of(response)["code"] == "request_too_large"


def test_unknown_route_and_method_keep_the_shape(server):
    response = httpx.get(server.url + "/v1/nothing", headers={"authorization": "Bearer key-1"})
    assert response.status_code == 404
    error_of(response)
    response = httpx.get(
        server.url + "/v1/chat/completions", headers={"authorization": "Bearer key-1"}
    )
    assert response.status_code == 405
    error_of(response)


def test_errors_are_counted(server):
    # its own 400 and 401: under pytest-xdist the module's other tests may run elsewhere
    assert post(server, "/v1/chat/completions", b"{not json").status_code == 400
    assert httpx.get(server.url + "/v1/models").status_code == 401
    text = httpx.get(server.url + "/metrics").text
    assert sample(text, 'specsplit_requests_total{endpoint="chat",status="400"}') >= 1
    assert sample(text, 'specsplit_requests_total{endpoint="models",status="401"}') >= 1


def test_labelled_counters_start_at_zero(tiny_dir):
    """Known label values have their series from the start, so rate() sees the first one."""
    with live(tiny_dir, [target(tiny_dir, "fresh")]) as fresh:
        text = httpx.get(fresh.url + "/metrics").text
    for role in ("draft", "target"):
        assert sample(text, f'specsplit_failovers_total{{role="{role}"}}') == 0
        assert sample(text, f'specsplit_history_resends_total{{role="{role}"}}') == 0
        assert sample(text, f'specsplit_hung_calls_total{{role="{role}"}}') == 0
        assert sample(text, f'specsplit_worker_restarts_total{{role="{role}"}}') == 0
    for status in ("400", "429", "500", "503"):
        assert sample(text, f'specsplit_requests_total{{endpoint="chat",status="{status}"}}') == 0
    assert sample(text, 'specsplit_round_phase_seconds_count{phase="draft"}') == 0
    assert sample(text, 'specsplit_accepted_tokens_per_position_total{position="16"}') == 0


def test_chunked_body_over_the_limit_is_413(server):
    def chunks():
        yield b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"a" * 1000
        yield b'"}]}'

    response = httpx.post(
        server.url + "/v1/chat/completions",
        content=chunks(),
        headers={"authorization": "Bearer key-1", "content-type": "application/json"},
    )
    assert response.status_code == 413
    assert error_of(response)["code"] == "request_too_large"


def test_more_choices_than_the_server_holds_is_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=["the"] * 3, n=2, max_tokens=2)
    assert info.value.body["param"] == "n"


def test_a_body_less_post_names_the_missing_body(server):
    response = post(server, "/v1/completions", b"")
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "missing_body"
    assert "None" not in error["message"]


@pytest.mark.parametrize("prompt", [[], [[]], [""]])
def test_an_empty_prompt_is_400_naming_prompt(client, prompt):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert info.value.body["param"] == "prompt"


@pytest.mark.parametrize("sampling", [{"temperature": 5e-324}, {"top_p": 5e-324}])
def test_vanishing_temperature_or_top_p_still_generates(client, sampling):
    reply = client.completions.create(model=MODEL, prompt="the cat", max_tokens=2, **sampling)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_the_schema_documents_what_the_server_sends(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert set(chat) == {"200", "400", "401", "404", "413", "429", "500", "503"}
    assert set(chat["200"]["content"]) == {"application/json", "text/event-stream"}
    assert chat["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorBody"
    }
    for operations in schema["paths"].values():
        for operation in operations.values():
            assert "422" not in operation["responses"]
    assert "HTTPValidationError" not in schema["components"]["schemas"]
