"""The active policy, its hot reload, and the routes only an admin key may call.

`PolicyStore.active` is replaced as a whole (policy + the Authenticator and the rollouts built from it):
a request takes the ActivePolicy once when it starts and finishes under it, whatever reloads meanwhile.
A reload comes from POST /admin/reload or from the file watcher (gateway/watch.py; the gateway's
background loop polls the file about once a second). One that fails (unreadable file, invalid YAML, a bad
key, a rollout variant no upstream serves) changes nothing: the gateway keeps its last good policy, logs
why, counts it in loragate_gateway_policy_reload_errors_total and shows it as `last_error` in GET
/admin/policy; POST /admin/reload answers 400 with the message naming the offending key.

Rollout state across reloads: a reload from the file keeps the state (windows, rollback) of every rollout
whose definition is unchanged; POST /admin/reload starts every rollout afresh and clears the rollbacks
shared with other replicas. Admission and breaker settings and the rate limiter's on_redis_error are
applied in place by `on_reload` (Gateway.apply_settings): new room is used at once, while requests in
flight or already queued keep what they had.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.responses import ApiError
from gateway.auth import Authenticator
from gateway.policy import Policy, PolicyError, read_policy
from gateway.rollout import RollbackEvent, RollbackShare, Rollouts

logger = logging.getLogger(__name__)

BEARER = {"WWW-Authenticate": "Bearer"}


def unauthorized(message: str) -> ApiError:
    return ApiError(401, "authentication_error", message, BEARER)


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


@dataclass(frozen=True, slots=True)
class ActivePolicy:
    policy: Policy
    auth: Authenticator
    rollouts: Rollouts
    sha256: str  # of the policy file's bytes (or of the canonical JSON of a policy built in code)
    loaded_at: float  # wall-clock time (time.time())


def check_variants(policy: Policy, served: frozenset[str]) -> None:
    """PolicyError naming the key when a rollout variant is an adapter no upstream serves.

    `served` empty means the upstreams have not been asked yet (or none answered): nothing to check then.
    """
    if not served:
        return
    for i, rollout in enumerate(policy.rollouts):
        for j, variant in enumerate(rollout.variants):
            if variant.adapter not in served:
                raise PolicyError(f"rollouts[{i}].variants[{j}].adapter: unknown adapter {variant.adapter!r} "
                                  "(no upstream serves it)")


class PolicyStore:
    def __init__(self, policy: Policy, path: Path | None, environ: Mapping[str, str] = os.environ,
                 share: RollbackShare | None = None,
                 on_rollback: Callable[[str, RollbackEvent], None] | None = None,
                 on_reload_error: Callable[[], None] | None = None,
                 on_reload: Callable[[Policy], None] | None = None) -> None:
        """`on_reload(policy)` runs after each switch, to apply settings that live outside the policy."""
        self.path = path
        self._environ = environ
        self._share = share
        self._on_rollback = on_rollback
        self._on_reload_error = on_reload_error
        self._on_reload = on_reload
        self.last_error: tuple[str, float] | None = None  # (message, wall-clock time)
        self.reload_errors = 0
        if path is not None and path.is_file():
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            digest = hashlib.sha256(json.dumps(policy.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()
        self.active = self._activate(policy, digest, previous=None)

    def _activate(self, policy: Policy, digest: str, previous: Rollouts | None) -> ActivePolicy:
        rollouts = Rollouts(policy.rollouts, self._share, previous=previous, on_rollback=self._on_rollback)
        return ActivePolicy(policy, Authenticator(policy, self._environ), rollouts, digest, time.time())

    def reload(self, served: frozenset[str] = frozenset(), *, fresh: bool = True) -> ActivePolicy:
        """Load the policy file again and switch to it; raises PolicyError (the old policy stays active).

        `served`: the adapters the upstreams serve (rollout variants must be among them, when known).
        `fresh`: start every rollout afresh (POST /admin/reload); otherwise unchanged rollouts keep their state.
        """
        try:
            if self.path is None:
                raise PolicyError("this gateway was not started from a policy file; nothing to reload")
            policy, digest = read_policy(self.path)
            try:
                check_variants(policy, served)
            except PolicyError as exc:
                raise PolicyError(f"{self.path}: {exc}") from None
            # Built before the switch: a bad env: key reference (PolicyError) leaves the old policy active.
            active = self._activate(policy, digest, previous=None if fresh else self.active.rollouts)
        except PolicyError as exc:
            self.last_error = (str(exc), time.time())
            self.reload_errors += 1
            if self._on_reload_error is not None:
                self._on_reload_error()
            logger.warning("policy reload refused, keeping sha256 %s: %s", self.active.sha256[:12], exc)
            raise
        self.active = active
        self.last_error = None  # shown until a reload succeeds
        if self._on_reload is not None:
            self._on_reload(policy)
        logger.info("policy reloaded from %s (sha256 %s)", self.path, active.sha256[:12])
        return active

    def describe(self) -> dict[str, Any]:
        active = self.active
        last = None if self.last_error is None else {"message": self.last_error[0], "at": _iso(self.last_error[1])}
        return {"policy": active.policy.model_dump(mode="json"), "sha256": active.sha256,
                "loaded_at": _iso(active.loaded_at),
                "path": str(self.path) if self.path is not None else None,
                "last_error": last, "reload_errors": self.reload_errors,
                "rollouts": active.rollouts.describe()}


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
