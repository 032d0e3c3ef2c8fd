"""HTTP routes. Each handler only dispatches to the Gateway on app.state.

Each route documents what it really answers: its 200 (JSON, and server-sent
events for the completion routes with stream=true) and every error status it
can send, each in the OpenAI error shape. FastAPI's own 422 is left out of
the schema: validation errors are answered with 400 (gateway/errors.py).
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, FastAPI, Request, Security
from fastapi.responses import FileResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from gateway.errors import APIError, error_responses
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.service import Gateway
from workers.draft.suffix import tenant_of

STATIC = Path(__file__).parent / "static"  # the playground's page and script


def gateway(request: Request) -> Gateway:
    return request.app.state.gateway


BEARER = HTTPBearer(auto_error=False)
Bearer = Annotated[HTTPAuthorizationCredentials | None, Security(BEARER)]


def require_api_key(request: Request, credentials: Bearer) -> None:
    """Bearer auth against SPECSPLIT_API_KEYS; open when no keys are set. Sets the
    request's tenant (a hash of its key; the suffix cache is per tenant)."""
    token = credentials.credentials.strip() if credentials is not None else ""
    request.state.tenant = tenant_of(token)
    keys = request.app.state.settings.keys
    if not keys:
        return
    if not any(hmac.compare_digest(token.encode(), k.encode()) for k in keys):
        raise APIError(
            401, "invalid or missing API key (Authorization: Bearer KEY)", None, "invalid_api_key"
        )


async def authenticate_v1(request: Request) -> None:
    """The key check for a /v1 request whose body failed validation (which FastAPI does
    before the dependencies): a request without a valid key hears 401 first, as OpenAI's API
    answers."""
    if request.url.path.startswith(v1.prefix + "/"):
        require_api_key(request, await BEARER(request))


class PoolCounts(BaseModel):
    serving: int  # workers passing health checks
    configured: int  # workers the gateway knows of


class Health(BaseModel):
    """The /health body, with 200 (ok) or 503 (unavailable)."""

    status: Literal["ok", "unavailable"]
    targets: PoolCounts | None = None
    drafts: PoolCounts | None = None  # absent when the draft is in the gateway or off


EVENT = {  # one server-sent event of a stream
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a chunk, an error body or [DONE]"}},
}
COMPLETION = {
    "description": "the completion; with stream=true its chunks as server-sent events, "
    "`data: {chunk}` ... `data: [DONE]`",
    "content": {"text/event-stream": {"itemSchema": EVENT}},
}
GENERATION_ERRORS = error_responses(400, 401, 404, 413, 429, 500, 503)

v1 = APIRouter(
    prefix="/v1",
    dependencies=[Security(require_api_key)],
    responses=error_responses(401, 500),
)
ops = APIRouter(responses=error_responses(500))


@v1.get("/models")
async def list_models(request: Request):
    return gateway(request).models()


@v1.get("/models/{model:path}", responses=error_responses(404))
async def retrieve_model(model: str, request: Request):
    return gateway(request).model(model)


@v1.post("/chat/completions", responses={200: COMPLETION, **GENERATION_ERRORS})
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return await gateway(request).chat(body, request)


@v1.post("/completions", responses={200: COMPLETION, **GENERATION_ERRORS})
async def completions(body: CompletionRequest, request: Request):
    return await gateway(request).completions(body, request)


@ops.get(
    "/health",
    responses={200: {"model": Health}, 503: {"model": Health, "description": "not serving"}},
)
async def health(request: Request):
    return gateway(request).health()


@ops.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}
    },
)
async def metrics(request: Request):
    body = generate_latest(request.app.state.metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@ops.get("/playground", include_in_schema=False)
async def playground():
    """The playground page; it calls /v1 with the key typed into it."""
    return FileResponse(STATIC / "playground.html")


def openapi(app: FastAPI) -> dict:
    """FastAPI's schema of the app, less the 422 responses this server never sends."""
    schema = FastAPI.openapi(app)
    for operations in schema["paths"].values():
        for operation in operations.values():
            operation["responses"].pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)
    return schema
