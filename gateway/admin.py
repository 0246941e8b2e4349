"""The active policy, its hot reload, and the routes only an admin key may call.

`PolicyStore.active` is replaced as a whole (policy + the Authenticator built from it), so a request sees
one consistent policy. A reload that fails (unreadable file, invalid YAML, a bad key) changes nothing: the
gateway keeps its last good policy and the caller gets 400 with the message naming the offending key.
Admission and breaker sizes, and the rate limiter's on_redis_error, are fixed when the gateway starts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.responses import ApiError
from gateway.auth import Authenticator
from gateway.policy import Policy, PolicyError, parse_policy

logger = logging.getLogger(__name__)

BEARER = {"WWW-Authenticate": "Bearer"}


def unauthorized(message: str) -> ApiError:
    return ApiError(401, "authentication_error", message, BEARER)


@dataclass(frozen=True, slots=True)
class ActivePolicy:
    policy: Policy
    auth: Authenticator
    sha256: str  # of the policy file's bytes (or of the canonical JSON of a policy built in code)
    loaded_at: float  # wall-clock time (time.time())


class PolicyStore:
    def __init__(self, policy: Policy, path: Path | None, environ: Mapping[str, str] = os.environ) -> None:
        self.path = path
        self._environ = environ
        if path is not None and path.is_file():
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            digest = hashlib.sha256(json.dumps(policy.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()
        self.active = ActivePolicy(policy, Authenticator(policy, environ), digest, time.time())

    def reload(self) -> ActivePolicy:
        """Load the policy file again; raises PolicyError (the old policy stays active)."""
        if self.path is None:
            raise PolicyError("this gateway was not started from a policy file; nothing to reload")
        try:
            raw = self.path.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise PolicyError(f"{self.path}: cannot read policy file: {exc}") from None
        policy = parse_policy(text)
        active = ActivePolicy(policy, Authenticator(policy, self._environ),
                              hashlib.sha256(raw).hexdigest(), time.time())
        self.active = active
        logger.info("policy reloaded from %s (sha256 %s)", self.path, active.sha256[:12])
        return active

    def describe(self) -> dict[str, Any]:
        active = self.active
        return {"policy": active.policy.model_dump(mode="json"), "sha256": active.sha256,
                "loaded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(active.loaded_at)),
                "path": str(self.path) if self.path is not None else None}


class AdminRoutes:
    def __init__(self, store: PolicyStore) -> None:
        self.store = store

    def _require_admin(self, request: Request) -> None:
        if not self.store.active.auth.is_admin(request.headers.get("authorization")):
            raise unauthorized("an admin key is required (Authorization: Bearer <admin key>)")

    async def policy(self, request: Request) -> Response:
        self._require_admin(request)
        return JSONResponse(self.store.describe())

    async def reload(self, request: Request) -> Response:
        self._require_admin(request)
        try:
            self.store.reload()
        except PolicyError as exc:
            logger.warning("policy reload refused: %s", exc)
            raise ApiError(400, "invalid_policy", str(exc)) from None
        return JSONResponse(self.store.describe())
