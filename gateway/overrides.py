"""Operator overrides on top of the file policy: suspended tenants, drained upstreams, breaker resets.

They are set through the admin API (gateway/admin.py, `loragate admin ...`) and change nothing in the
policy file. With Redis they live in one hash, `loragate:overrides`, that every replica reads at each
housekeeping round (about once a second), so a suspension or a drain sent to any replica holds on all of
them and outlives a gateway restart. Without Redis they belong to the replica that was told.

- A suspended tenant's requests get 403 `tenant_suspended` with the operator's reason; it stays in the
  policy (its keys, limits and adapters), so resuming it restores everything at once.
- A drained upstream gets no new request; the requests in flight on it finish (gateway/admission.py).
- A breaker reset is not a lasting state: it is published as a stamp (upstream, time), and every replica
  closes its own breaker for that upstream once per new stamp.

Overrides are cleared all at once by POST /admin/reload (which starts the policy afresh), by POST
/admin/overrides/clear, or by starting a gateway with --clear-overrides. A change made while Redis is
unreachable applies here at once and is written when Redis is back (until then the other replicas do
not see it).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from gateway.clock import iso_time

logger = logging.getLogger(__name__)

TENANT, UPSTREAM, BREAKER = "tenant", "upstream", "breaker"  # suspended, drained, reset stamp


@dataclass(frozen=True, slots=True)
class Override:
    kind: str  # TENANT | UPSTREAM | BREAKER
    target: str  # a tenant id or an upstream URL
    reason: str
    by: str  # who asked (gateway/admin.py's `actor`)
    at: float  # wall-clock time

    @property
    def field(self) -> str:
        return f"{self.kind}:{self.target}"

    def dumps(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def loads(cls, text: str) -> Override | None:
        try:
            d = json.loads(text)
            return cls(str(d["kind"]), str(d["target"]), str(d["reason"]), str(d["by"]), float(d["at"]))
        except (ValueError, KeyError, TypeError):
            return None

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target, "reason": self.reason, "by": self.by, "at": iso_time(self.at)}


class HashShare(Protocol):
    """The part of the replicas' shared store overrides use (gateway/fleet_store.py)."""

    shared: bool

    async def read_hash(self, key: str) -> dict[str, str]: ...
    async def update_hash(self, key: str, put: dict[str, str], remove: list[str]) -> None: ...
    async def clear(self, keys: list[str]) -> None: ...


class Overrides:
    KEY = "loragate:overrides"

    def __init__(self, share: HashShare, wall: Callable[[], float] = time.time) -> None:
        self.share = share
        self._wall = wall
        self.entries: dict[str, Override] = {}  # by field, as last read (plus what is pending)
        self._pending: dict[str, Override | None] = {}  # changes not yet in the shared store (None: removed)
        self._clear_pending = False
        self._seen_resets: dict[str, float] = {}  # upstream URL -> the newest reset stamp acted on
        self._started = wall()

    # ---- reading ----

    def suspended(self, tenant: str) -> Override | None:
        return self.entries.get(f"{TENANT}:{tenant}")

    def drained(self) -> set[str]:
        return {o.target for o in self.entries.values() if o.kind == UPSTREAM}

    def describe(self) -> dict[str, Any]:
        """For GET /admin/policy: the suspended tenants and drained upstreams, with who, when and why."""

        def of(kind: str) -> list[dict[str, Any]]:
            return [o.to_json() for o in sorted(self.entries.values(), key=lambda o: o.target) if o.kind == kind]

        return {
            "suspended_tenants": of(TENANT),
            "drained_upstreams": of(UPSTREAM),
            "shared": self.share.shared,
            "unsaved": len(self._pending) + self._clear_pending,
        }

    # ---- changing ----

    async def put(self, kind: str, target: str, reason: str, by: str) -> bool:
        """Set an override; False when it is already set (its first reason stands). A breaker stamp is
        always new."""
        override = Override(kind, target, reason, by, self._wall())
        if kind != BREAKER and override.field in self.entries:
            return False
        self.entries[override.field] = override
        if kind == BREAKER:
            self._seen_resets[target] = override.at  # this replica resets its own breaker itself
        await self._write({override.field: override})
        return True

    async def remove(self, kind: str, target: str) -> bool:
        """Lift an override; False when none was set."""
        field = f"{kind}:{target}"
        if self.entries.pop(field, None) is None:
            return False
        await self._write({field: None})
        return True

    async def clear(self) -> None:
        """Lift every override, here and in the shared store."""
        self.entries.clear()
        self._pending.clear()
        self._clear_pending = True
        await self._flush()

    async def _write(self, changes: dict[str, Override | None]) -> None:
        self._pending.update(changes)
        try:
            await self._flush()
        except Exception as exc:  # Redis down: kept, written at a later sync
            logger.warning("could not share an override yet (applied on this replica): %s", exc)

    async def _flush(self) -> None:
        if not self.share.shared:
            self._pending.clear()
            self._clear_pending = False
            return
        if self._clear_pending:
            await self.share.clear([self.KEY])
            self._clear_pending = False
        pending, self._pending = self._pending, {}
        if not pending:
            return
        try:
            await self.share.update_hash(
                self.KEY,
                {f: o.dumps() for f, o in pending.items() if o is not None},
                [f for f, o in pending.items() if o is None],
            )
        except Exception:
            self._pending = {**pending, **self._pending}
            raise

    # ---- the housekeeping round ----

    async def sync(self) -> list[str]:
        """Write what is pending, adopt what the fleet holds; returns the upstreams whose breaker a new
        reset stamp asks to close here."""
        if not self.share.shared:
            return []
        await self._flush()
        found = await self.share.read_hash(self.KEY)
        entries = {}
        for field, text in found.items():
            override = Override.loads(text)
            if override is not None and override.field == field:
                entries[field] = override
        self.entries = entries
        resets = []
        for override in entries.values():
            if override.kind == BREAKER and override.at > self._seen_resets.get(override.target, self._started):
                self._seen_resets[override.target] = override.at
                resets.append(override.target)
        return resets
