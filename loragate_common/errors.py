"""The JSON error every route of the engine and the gateway answers: {"error": {"type": ..., "message": ...}}.

Bad input raises an `ApiError` at the edge; each app's exception handler turns it into this body, with the
status and headers it carries (Retry-After, X-Loragate-Reason, WWW-Authenticate). A value the client sent
is quoted with `shown`, so a hostile one is never echoed whole.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response


class ApiError(Exception):
    """An HTTP error answered as {"error": {"type": ..., "message": ...}}."""

    def __init__(self, status: int, type_: str, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.headers = dict(headers or {})

    def response(self) -> JSONResponse:
        return error_response(self.status, self.type, self.message, self.headers)


def error_body(type_: str, message: str) -> dict[str, Any]:
    return {"error": {"type": type_, "message": message}}


def error_response(status: int, type_: str, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(type_, message), status_code=status, headers=dict(headers or {}))


def shown(value: str, limit: int = 100) -> str:
    """A client's value as an error message quotes it: repr, cut to `limit` characters (never echoed whole)."""
    return repr(value) if len(value) <= limit else f"{value[:limit]!r}..."


def bad_request(message: str) -> ApiError:
    return ApiError(400, "invalid_request_error", message)


def adapter_not_found(adapter_id: str) -> ApiError:
    return ApiError(404, "adapter_not_found", f"adapter {shown(adapter_id)} is not loaded")


def too_large(limit: int) -> ApiError:
    return ApiError(413, "request_too_large", f"body: larger than {limit} bytes")


def unauthorized(message: str) -> ApiError:
    return ApiError(401, "authentication_error", message, {"WWW-Authenticate": "Bearer"})


def retry_after(seconds: float) -> str:
    """A Retry-After value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))


def unavailable(
    message: str, reason: str, retry_after_s: float = 1.0, headers: Mapping[str, str] | None = None
) -> ApiError:
    """The 503 every "not now" answers (engine and gateway alike): Retry-After, and the X-Loragate-Reason
    a client or an operator can act on (draining, queue_full, circuit_open, ...)."""
    return ApiError(
        503,
        "service_unavailable",
        message,
        {**(headers or {}), "Retry-After": retry_after(retry_after_s), "X-Loragate-Reason": reason},
    )


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    type_ = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return error_response(exc.status_code, type_, f"{request.method} {request.url.path}: {exc.detail}", exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    # Starlette re-raises the exception after this response is sent; uvicorn logs it.
    return error_response(500, "internal_error", "internal server error")


HANDLERS: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
    ApiError: _api_error,
    HTTPException: _http_error,
    Exception: _server_error,
}
"""A Starlette app's `exception_handlers` (the gateway's, the vLLM agent's): every error as this module's JSON."""
