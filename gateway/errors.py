"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}.

Every failure a client can see goes through `APIError`: raised by handlers,
by the generation loop, or made here from FastAPI's own validation errors and
from unexpected exceptions, so no response is ever a bare 422 or 500 page.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("specsplit.gateway")

TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


STATUS_MEANING = {
    400: "a malformed request, or one asking for what this server does not build",
    401: "a missing or wrong API key (only when the server is given keys)",
    404: "the model is not the one this server serves",
    413: "the request body is over the server's limit",
    429: "the server is full and its admission queue too, or the request waited past the "
    "queue's bound: retry after Retry-After seconds",
    500: "an unexpected server error",
    503: "no healthy target worker, or the server is shutting down: retry after Retry-After "
    "seconds",
}


class ErrorDetail(BaseModel):
    message: str  # for people
    type: str  # invalid_request_error, rate_limit_error, server_error, service_unavailable
    param: str | None  # the request field at fault, e.g. "messages[0].role"
    code: str | None  # for programs, e.g. "model_not_found", "context_length_exceeded"


class ErrorBody(BaseModel):
    """The body of every error response."""

    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int, dict]:
    """The `responses=` of a route that can answer these statuses, each with an ErrorBody."""
    return {s: {"model": ErrorBody, "description": STATUS_MEANING[s]} for s in statuses}


class APIError(StarletteHTTPException):
    """An HTTP error in the OpenAI shape. An HTTPException, so that FastAPI passes it on
    unchanged from anywhere, the reading of the request body included."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(status, message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    @property
    def body(self) -> dict:
        kind = TYPES.get(
            self.status, "server_error" if self.status >= 500 else "invalid_request_error"
        )
        detail = ErrorDetail(message=self.message, type=kind, param=self.param, code=self.code)
        return ErrorBody(error=detail).model_dump()

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body, status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def unsupported(param: str, what: str = "is not supported by this server") -> APIError:
    return APIError(400, f"`{param}` {what}", param, "unsupported_parameter")


TYPE_TAG = re.compile(r"^(str|int|float|bool|none|(list|dict|literal)\[.*\]|function-.*|[A-Z]\w*)$")


def param_path(loc: tuple | list) -> str | None:
    """("body", "messages", 0, "content") -> "messages[0].content".

    Skips the location's root and the union member tags pydantic adds (str, list[int], Model).
    """
    out = ""
    for part in loc[1:] if loc and loc[0] in ("body", "query", "header", "path") else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not TYPE_TAG.match(str(part)):
            out += f".{part}" if out else str(part)
    return out or None


def validation_error(error: RequestValidationError, json_sent: bool = True) -> APIError:
    """The 400 of a body that failed validation; `json_sent`: the request said its body is
    JSON (Content-Type), without which FastAPI does not read it as JSON."""
    first = error.errors()[0] if error.errors() else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        return bad_request("the request body is not valid JSON", None, "invalid_json")
    if not json_sent:
        return bad_request(
            "the request body must be JSON, sent with Content-Type: application/json",
            None,
            "invalid_body",
        )
    param = param_path(first.get("loc", ()))
    message = str(first.get("msg", "invalid value"))
    if first.get("type") == "missing" and param is None:
        return bad_request("the request body is required (a JSON object)", None, "missing_body")
    if first.get("type") == "missing":
        return bad_request(f"`{param}` is required", param, "missing_required_parameter")
    if first.get("type") == "extra_forbidden":
        return bad_request(f"unrecognized request argument: `{param}`", param, "unknown_parameter")
    if first.get("type") in ("model_type", "dict_type") and param is None:
        return bad_request("the request body must be a JSON object", None, "invalid_body")
    return bad_request(f"`{param}`: {message}" if param else message, param, "invalid_value")


def install_error_handlers(
    app: FastAPI, authenticate: Callable[[Request], Awaitable[None]]
) -> None:
    """`authenticate` raises the APIError a request's credentials earn, if any: it is
    answered before what is wrong with the request's body."""

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        try:
            await authenticate(request)
        except APIError as refused:
            return refused.response()
        content_type = request.headers.get("content-type", "")  # none is read as JSON
        return validation_error(
            error, json_sent=not content_type or "json" in content_type
        ).response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if error.status_code == 404 else None
        return APIError(error.status_code, str(error.detail), None, code).response()

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return APIError(
            500, f"internal error: {type(error).__name__}", None, "internal_error"
        ).response()
