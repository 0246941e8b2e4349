"""The routes only an admin key may call: GET /admin/policy (the active policy, its reload state, the
rollouts and the routing) and POST /admin/reload (reload the policy file now, gateway/reload.py).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.policy import PolicyError
from gateway.reload import PolicyStore
from loragate.errors import ApiError

logger = logging.getLogger(__name__)

BEARER = {"WWW-Authenticate": "Bearer"}


def unauthorized(message: str) -> ApiError:
    return ApiError(401, "authentication_error", message, BEARER)


class AdminRoutes:
    def __init__(self, store: PolicyStore, served: Callable[[], Awaitable[frozenset[str]]],
                 routing: Callable[[], dict[str, Any]] = dict) -> None:
        """`served`: the adapter ids the upstreams serve now (refreshed), to check rollout variants against;
        `routing`: the upstreams' state and adapter affinity, shown in GET /admin/policy."""
        self.store = store
        self._served = served
        self._routing = routing

    def _require_admin(self, request: Request) -> None:
        if not self.store.active.auth.is_admin(request.headers.get("authorization")):
            raise unauthorized("an admin key is required (Authorization: Bearer <admin key>)")

    async def policy(self, request: Request) -> Response:
        self._require_admin(request)
        return JSONResponse({**self.store.describe(), "routing": self._routing()})

    async def reload(self, request: Request) -> Response:
        """Reload the file now; every rollout starts afresh, here and (through Redis) on every replica."""
        self._require_admin(request)
        try:
            active = self.store.reload(await self._served(), fresh=True)
        except PolicyError as exc:
            raise ApiError(400, "invalid_policy", str(exc)) from None
        try:
            await active.rollouts.clear_shared()
        except Exception as exc:  # Redis down: this replica is fresh, the others keep a shared rollback
            logger.warning("could not clear the shared rollbacks: %s", exc)
        return JSONResponse(self.store.describe())
