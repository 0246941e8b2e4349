"""Helpers shared by the gateway's HTTP tests: an in-process (ASGI) client, the error assertion, and a fake
engine that knows the adapter catalog (`CatalogEngine`).

Servers and processes are started with tests/processes.py, policies written with tests/policies.py,
conditions awaited with tests/polling.py. Nothing here imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.policy import parse_policy
from gateway.rollout import pick_variant

import policies
from mock_upstream import MockUpstream, Received
from policies import tenant_yaml


@contextlib.asynccontextmanager
async def asgi(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=30) as client:
        yield client


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def assert_error(resp: httpx.Response, status: int, type_: str | None = None, reason: str | None = None) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    if type_ is not None:
        assert error["type"] == type_
    if reason is not None:
        assert resp.headers["X-Loragate-Reason"] == reason
        assert int(resp.headers["Retry-After"]) >= 1


# ---- the rollout and reload tests' policy: acme may use the rollout `support` (a1 90 / a2 10) and a1 ----

KEY, OTHER_KEY = "acme-secret", "globex-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
COMPLETION = {"prompt": "hello", "max_tokens": 4}

ROLLBACK = "{max_error_rate: 0.2, max_ttft_p99_ms: 60000, min_requests: 10, window_s: 60}"


def rollout_policy_yaml(
    *,
    weights: tuple[float, float] = (90, 10),
    rollback: str | None = ROLLBACK,
    sticky: str = "header:X-User-ID",
    acme_adapters: str = '["support", "a1"]',
    variants: tuple[str, str] = ("a1", "a2"),
    extra: str = "",
) -> str:
    rollback_line = f"\n    rollback: {rollback}" if rollback else ""
    rollout = f"""  - name: support
    sticky_key: {sticky}
    variants: [{{adapter: {variants[0]}, weight: {weights[0]}}}, {{adapter: {variants[1]}, weight: {weights[1]}}}]
    override_header: X-Variant{rollback_line}"""
    return policies.policy_yaml(
        tenant_yaml("acme", KEY, acme_adapters),
        tenant_yaml("globex", OTHER_KEY, '["*"]'),
        rollouts=rollout,
        admission="{max_inflight_per_upstream: 64, max_queue: 64, queue_timeout_ms: 5000}",
        extra=extra,
    )


def support(user: str | None = None, auth: dict[str, str] = AUTH, **headers: str) -> dict[str, str]:
    out = {**auth, "X-Adapter-ID": "support", **headers}
    if user is not None:
        out["X-User-ID"] = user
    return out


def canary_users(text: str, n: int, start: int = 0) -> list[str]:
    """The first `n` users (from `start`) the split sends to the canary variant (the second)."""
    rollout = parse_policy(text).rollout("support")
    assert rollout is not None
    users, i = [], start
    while len(users) < n:
        if pick_variant(rollout, f"user-{i}").adapter == rollout.variants[1].adapter:
            users.append(f"user-{i}")
        i += 1
    return users


# ---- fake engines that know the adapter catalog (the tests of gateway/adapter_catalog.py) ----


@dataclass
class AdapterReply:
    """What a CatalogEngine answers every generation request with: an adapter's download state."""

    status: int  # 503 adapter_loading, 502 adapter_fetch_failed, ...
    reason: str | None  # its X-Loragate-Reason (None: none)
    retry_after: str = "7"


class CatalogEngine(MockUpstream):
    """A MockUpstream that also answers GET /v1/adapters with `cards` (None: 404, as an engine without the
    route), and, while `reply` is set, answers generation requests with it (after recording them)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cards: list[dict[str, Any]] | None = []
        self.reply: AdapterReply | None = None

    def _app(self) -> Starlette:
        app = super()._app()
        app.router.routes.insert(0, Route("/v1/adapters", self._adapters, methods=["GET"]))
        return app

    async def _adapters(self, request: Request) -> Response:
        if self.cards is None:
            return JSONResponse({"error": {"type": "not_found", "message": "no such route"}}, status_code=404)
        return JSONResponse({"object": "list", "data": self.cards})

    async def _generate(self, request: Request) -> Response:
        reply = self.reply
        if reply is None:
            return await super()._generate(request)
        with self._lock:
            self.received.append(Received(request.url.path, dict(request.headers), json.loads(await request.body())))
        headers = {"Retry-After": reply.retry_after}
        if reply.reason is not None:
            headers["X-Loragate-Reason"] = reply.reason
        error = {"error": {"type": reply.reason or "mock_error", "message": f"engine says {reply.reason}"}}
        return JSONResponse(error, status_code=reply.status, headers=headers)
