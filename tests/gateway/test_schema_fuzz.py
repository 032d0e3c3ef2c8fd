"""Schemathesis against the live gateway: it answers only as its OpenAPI schema says.

Requests generated from /openapi.json, valid ones and (for the bodies)
malformed ones, must get no 5xx and only documented status codes, content
types and bodies; malformed ones must get a 4xx. The server's limits keep each
generation short (at most 16 tokens, 2 choices, 2 prompts) and the examples
are bounded, so the file runs in seconds.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.config._checks import (
    NEGATIVE_DATA_REJECTION_EXPECTED_STATUSES,
    NegativeDataRejectionConfig,
)
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.gateway.helpers import MODEL, live, target

KEY = "fuzz-key"
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]
POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
# valid bodies keep the fields that shape a generation; the refused OpenAI features
# (tools, penalties, ...) would make most of them a 400 (test_errors.py covers those)
GENERATION_FIELDS = {
    *("model", "messages", "prompt", "max_tokens", "max_completion_tokens", "n", "stop"),
    *("temperature", "top_p", "top_k", "seed", "stream", "stream_options", "user"),
    *("logprobs", "top_logprobs", "echo", "speculation_stats"),
}
BODIES = ["POST /v1/chat/completions", "POST /v1/completions"]
# (operation, mode, examples): the request bodies get most of them
RUNS = [
    *[(op, mode, 40) for op in BODIES for mode in (POSITIVE, NEGATIVE)],
    *[(op, POSITIVE, 3) for op in ("GET /v1/models", "GET /v1/models/{model}")],
    *[(op, POSITIVE, 3) for op in ("GET /health", "GET /metrics")],
]


@pytest.fixture(scope="module")
def server(tiny_dir):
    limits = dict(max_tokens_limit=16, max_n=2, max_prompts=2, max_body_bytes=16_384)
    with live(tiny_dir, [target(tiny_dir)], api_keys=KEY, **limits) as g:
        yield g


@pytest.fixture(scope="module")
def api_schema(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    # a malformed body may also be too large: 413 (documented) rejects it as well as a 400
    refused = [*NEGATIVE_DATA_REJECTION_EXPECTED_STATUSES, "413"]
    schema.config.checks.negative_data_rejection = NegativeDataRejectionConfig(
        expected_statuses=refused
    )
    return schema


def test_every_operation_is_fuzzed(api_schema):
    operations = {result.ok().label for result in api_schema.get_all_operations()}
    assert operations == {op for op, _, _ in RUNS}


@pytest.mark.parametrize(("label", "mode", "examples"), RUNS, ids=lambda v: str(v))
def test_the_gateway_answers_as_its_schema_says(api_schema, label, mode, examples):
    operation = api_schema.find_operation_by_label(label)

    @given(case=operation.as_strategy(mode))
    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,  # the same examples on every run: CI does not flake
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    def answers_as_documented(case):
        if mode == POSITIVE and isinstance(case.body, dict):
            case.body = {k: v for k, v in case.body.items() if k in GENERATION_FIELDS}
        if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
            case.body["model"] = MODEL  # past the 404 for an unknown model, into generation
        case.call_and_validate(headers={"authorization": f"Bearer {KEY}"}, checks=CHECKS)

    answers_as_documented()
