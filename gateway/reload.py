"""The active policy and its hot reload.

`PolicyStore.active` is replaced as a whole (policy + the Authenticator and the rollouts built from it):
a request takes the ActivePolicy once when it starts and finishes under it, whatever reloads meanwhile.
A reload comes from POST /admin/reload (gateway/admin.py) or from the file watcher (gateway/watch.py; the
gateway's background loop polls the file about once a second). One that fails (unreadable file, invalid
YAML, a bad key, a rollout variant no upstream serves) changes nothing: the gateway keeps its last good
policy, logs why, counts it in loragate_gateway_policy_reload_errors_total and shows it as `last_error`
in GET /admin/policy until a reload succeeds.

Rollout state across reloads: a reload from the file keeps the state (windows, rollback) of every rollout
whose definition is unchanged; POST /admin/reload starts every rollout afresh and clears the rollbacks
shared with other replicas. Admission and breaker settings and the rate limiter's on_redis_error are
applied in place by `on_reload` (gateway/app.py's Gateway.apply_settings): new room is used at once, while requests in
flight or already queued keep what they had.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.auth import Authenticator
from gateway.clock import iso_time
from gateway.fleet_store import FleetStore
from gateway.policy import Policy, PolicyError, read_policy
from gateway.progress import Control
from gateway.rollback import RollbackEvent
from gateway.rollout import Rollouts

logger = logging.getLogger(__name__)


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
                raise PolicyError(
                    f"rollouts[{i}].variants[{j}].adapter: unknown adapter {variant.adapter!r} (no upstream serves it)"
                )


class PolicyStore:
    def __init__(
        self,
        policy: Policy,
        path: Path | None,
        environ: Mapping[str, str] = os.environ,
        share: FleetStore | None = None,
        on_rollback: Callable[[str, RollbackEvent], None] | None = None,
        on_reload_error: Callable[[], None] | None = None,
        on_reload: Callable[[Policy], None] | None = None,
        on_step: Callable[[str, Control], None] | None = None,
    ) -> None:
        """`on_reload(policy)` runs after each switch, to apply settings that live outside the policy;
        `on_step(rollout, control)` when a progressive rollout moves on (gateway/progress.py)."""
        self.path = path
        self._environ = environ
        self._share = share
        self._on_rollback = on_rollback
        self._on_reload_error = on_reload_error
        self._on_reload = on_reload
        self._on_step = on_step
        self.last_error: tuple[str, float] | None = None  # (message, wall-clock time)
        self.reload_errors = 0
        if path is not None and path.is_file():
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            digest = hashlib.sha256(json.dumps(policy.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()
        self.active = self._activate(policy, digest, previous=None)

    def _activate(self, policy: Policy, digest: str, previous: Rollouts | None) -> ActivePolicy:
        rollouts = Rollouts(
            policy.rollouts, self._share, previous=previous, on_rollback=self._on_rollback, on_step=self._on_step
        )
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
        last = None if self.last_error is None else {"message": self.last_error[0], "at": iso_time(self.last_error[1])}
        return {
            "policy": active.policy.model_dump(mode="json"),
            "sha256": active.sha256,
            "loaded_at": iso_time(active.loaded_at),
            "path": str(self.path) if self.path is not None else None,
            "last_error": last,
            "reload_errors": self.reload_errors,
            "rollouts": active.rollouts.describe(),
        }
