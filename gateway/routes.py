"""The gateway's routes besides generation: the model list, probes, metrics, and JSON error handlers."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from loragate.errors import ApiError, error_response
from loragate.http_io import list_body

if TYPE_CHECKING:
    from gateway.app import Gateway


class Api:
    """The other routes: the model list, probes, metrics."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self.created = int(time.time())

    async def models(self, request: Request) -> Response:
        active = self.gw.store.active
        tenant = self.gw.tenant(request, active)
        models = await self.gw.catalog.models()
        base = sorted(models.bases)[0] if models.bases else None
        ids = [(b, None) for b in sorted(models.bases)]
        ids += [(a, base) for a in sorted(models.adapters) if tenant.allows(a)]
        ids += [(r.name, base) for r in active.policy.rollouts if tenant.allows(r.name)]
        cards = [
            {"id": i, "object": "model", "created": self.created, "owned_by": "loragate", "root": i, "parent": parent}
            for i, parent in ids
        ]
        return JSONResponse(list_body(cards), headers=self.gw.known_headers(tenant.id))

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        if self.gw.draining:
            raise ApiError(
                503, "service_unavailable", "draining", {"Retry-After": "1", "X-Loragate-Reason": "draining"}
            )
        fails_closed = self.gw.store.active.policy.ratelimit.on_redis_error == "closed"
        if fails_closed and not await self.gw.limiter.healthy():
            raise ApiError(
                503,
                "service_unavailable",
                "the rate limiter's store is unreachable",
                {"Retry-After": "1", "X-Loragate-Reason": "ratelimit_unavailable"},
            )
        return JSONResponse({"status": "ready"})

    async def metrics_text(self, request: Request) -> Response:
        body, content_type = self.gw.metrics.render()
        return Response(body, headers={"Content-Type": content_type})


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc.status, exc.type, exc.message, exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    type_ = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return error_response(exc.status_code, type_, f"{request.method} {request.url.path}: {exc.detail}", exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    # Starlette re-raises the exception after this response is sent; uvicorn logs it.
    return error_response(500, "internal_error", "internal server error")


HANDLERS: dict[Any, Callable[..., Awaitable[Response]]] = {
    ApiError: _api_error,
    HTTPException: _http_error,
    Exception: _server_error,
}
