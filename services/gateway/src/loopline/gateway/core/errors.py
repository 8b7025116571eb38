"""Errors the gateway answers with, in the shape each client family expects.

OpenAI clients read ``{"error": {"message", "type", "param", "code"}}``; ScalarLM's client and
FastAPI users read ``{"detail": ...}``. Both carry an honest status code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loopline.common.contracts.schemas import QUEUED_ROUTES, openai_error
from loopline.common.runtime.service_client import ServiceError

_TYPES = {400: "invalid_request_error", 404: "not_found_error", 409: "conflict_error",
          413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _TYPES.get(status, "server_error")
        self.headers = headers or {}


def from_service_error(exc: ServiceError) -> ApiError:
    """A service's refusal or silence (loopline.common.runtime.service_client) as the gateway's answer: the
    same status and message, and Retry-After when trying again soon may work."""
    retry = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
    return ApiError(exc.status, exc.message, headers=retry)


def is_openai_path(path: str) -> bool:
    """Routes whose clients read OpenAI's error shape: vLLM's relayed routes and /v1/models."""
    return path in QUEUED_ROUTES or path == "/v1/models" or path.startswith("/v1/models/")


def error_body(path: str, status: int, message: str, *, param: str | None = None,
               type: str | None = None) -> dict[str, Any]:
    """The error as the route's clients read it: OpenAI's shape, or FastAPI's and ScalarLM's."""
    if is_openai_path(path):
        return openai_error(status, message, type or _TYPES.get(status, "server_error"), param)
    return {"detail": message}


def error_response(request: Request, status: int, message: str, *, param: str | None = None,
                   type: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(request.url.path, status, message, param=param, type=type),
                        status_code=status, headers=headers)


def _describe(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    where = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg')}", None
    return f"{where or 'body'}: {first.get('msg')}", where


def install(app) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return error_response(request, exc.status, exc.message, param=exc.param, type=exc.type,
                              headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = _describe(exc.errors())
        malformed = any(e.get("type") == "json_invalid" for e in exc.errors())
        # Malformed JSON is a 400 everywhere; a well-formed body with wrong fields is 400 for OpenAI
        # routes (as OpenAI answers) and 422 for the others (as ScalarLM/FastAPI answer).
        status = 400 if malformed or is_openai_path(request.url.path) else 422
        return error_response(request, status, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(request, exc.status_code, str(exc.detail),
                              headers=getattr(exc, "headers", None))
