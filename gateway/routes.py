"""HTTP routes. Each handler only dispatches to the Gateway on app.state."""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.errors import APIError
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.service import Gateway


def gateway(request: Request) -> Gateway:
    return request.app.state.gateway


def require_api_key(request: Request) -> None:
    """Bearer auth against SPECSPLIT_API_KEYS; open when no keys are set."""
    keys = request.app.state.settings.keys
    if not keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not any(
        hmac.compare_digest(token.strip().encode(), k.encode()) for k in keys
    ):
        raise APIError(
            401, "invalid or missing API key (Authorization: Bearer KEY)", None, "invalid_api_key"
        )


v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])
ops = APIRouter()


@v1.get("/models")
async def list_models(request: Request):
    return gateway(request).models()


@v1.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return await gateway(request).chat(body, request)


@v1.post("/completions")
async def completions(body: CompletionRequest, request: Request):
    return await gateway(request).completions(body, request)


@ops.get("/health")
async def health(request: Request):
    return gateway(request).health()


@ops.get("/metrics")
async def metrics(request: Request):
    body = generate_latest(request.app.state.metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
