"""The fleet's adapter catalog: adapter ids, each with numbered versions pinned to a source and a digest.

  id         `name` or `tenant/name` (loragate_common/adapter_ids.py); `ID@N` names version N, `ID` alone the newest
             version not deprecated (all deprecated: the newest)
  version    {version, source, sha256, size, revision, published_by, published_at, deprecated}
  entry      the id's versions, its tenant (the namespace owner; None for the operators' own) and a
             deprecated flag of its own (gateway/catalog_entry.py)

A request naming a catalog id is sent to an engine as `ID@N` with the version's source and digest
(`Pinned.headers`), and the engine fetches it on first use. Versions are never renumbered: a deleted version's
number, or a deleted id's, is never given again (a deleted id keeps a tombstone with its next number), so
an engine that still holds `ID@N` never serves other content under that name.

Reads on the request path (`resolve`) come from a snapshot in memory, refreshed from the store about once a
second (`refresh`, from the gateway's housekeeping round) and replaced at once by this replica's own writes.
The store (gateway/catalog_store.py) is a Redis hash shared by the replicas, or this process's memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from gateway.catalog_entry import AdapterVersion, CatalogEntry, live, parse_entries
from gateway.catalog_store import CatalogStore, Writes
from gateway.redis_client import UNREACHABLE
from loragate_common.adapter_ids import split_ref
from loragate_common.errors import ApiError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Pinned:
    """A request's catalog adapter: `ref` (ID@N) is what the engine serves, fetched from the version's source."""

    ref: str
    version: AdapterVersion
    deprecated: bool

    def headers(self) -> dict[str, str]:
        """What the proxy sends the engine with X-Adapter-ID: ref (only the gateway ever sets these)."""
        out = {"X-Adapter-Source": self.version.source, "X-Adapter-SHA256": self.version.sha256}
        if self.version.size is not None:
            out["X-Adapter-Size"] = str(self.version.size)
        return out


@dataclass(frozen=True, slots=True)
class Registration:
    id: str
    source: str
    sha256: str
    size: int | None
    revision: str | None
    tenant: str | None
    published_by: str


@dataclass(frozen=True, slots=True)
class Quota:
    """A publishing tenant's bounds: versions of its ids (deleted ones not counted) and their declared bytes."""

    tenant: str
    max_adapters: int
    max_bytes: int


def _check_quota(entries: dict[str, CatalogEntry], reg: Registration, quota: Quota) -> None:
    owned = [v for e in live(entries.values()) if e.tenant == quota.tenant for v in e.versions]
    if len(owned) + 1 > quota.max_adapters:
        raise ApiError(
            403,
            "quota_exceeded",
            f"tenant {quota.tenant!r} has {len(owned)} adapter versions published (publish_quota.max_adapters: "
            f"{quota.max_adapters}); delete old versions first",
        )
    used = sum(v.size or 0 for v in owned)
    if used + (reg.size or 0) > quota.max_bytes:
        raise ApiError(
            403,
            "quota_exceeded",
            f"tenant {quota.tenant!r} has {used} bytes of adapters published; {reg.size} more would pass "
            f"publish_quota.max_bytes ({quota.max_bytes})",
        )


def register_change(
    reg: Registration, quota: Quota | None, now: float
) -> Callable[[dict[str, str]], tuple[Writes, tuple[CatalogEntry, AdapterVersion, bool]]]:
    """The store change that registers `reg`: (entry, its version, whether it is new). The same source and
    digest as the newest version is that version again (nothing written)."""

    def change(fields: dict[str, str]) -> tuple[Writes, tuple[CatalogEntry, AdapterVersion, bool]]:
        entries = parse_entries(fields)
        entry = entries.get(reg.id)
        if entry is not None and entry.versions:
            newest = entry.versions[-1]
            if reg.tenant is not None and entry.tenant is not None and reg.tenant != entry.tenant:
                raise ApiError(409, "conflict", f"adapter {reg.id!r} belongs to tenant {entry.tenant!r}")
            if (newest.source, newest.sha256) == (reg.source, reg.sha256):
                return {}, (entry, newest, False)
        if quota is not None:
            _check_quota(entries, reg, quota)
        number = entry.next_version if entry is not None else 1
        version = AdapterVersion(number, reg.source, reg.sha256, reg.size, reg.revision, reg.published_by, now)
        if entry is None or not entry.versions:
            entry = CatalogEntry(reg.id, reg.tenant, (version,), number + 1)
        else:
            tenant = entry.tenant if entry.tenant is not None else reg.tenant
            entry = replace(entry, tenant=tenant, versions=(*entry.versions, version), next_version=number + 1)
        return {reg.id: entry.dumps()}, (entry, version, True)

    return change


def _found(entries: dict[str, CatalogEntry], adapter_id: str, number: int | None) -> CatalogEntry:
    """The live entry `adapter_id` (having version `number`, when given); 404 otherwise."""
    entry = entries.get(adapter_id)
    if entry is None or not entry.versions:
        raise ApiError(404, "not_found", f"no adapter {adapter_id!r} in the catalog")
    if number is not None and entry.version(number) is None:
        have = ", ".join(str(v.version) for v in entry.versions)
        raise ApiError(404, "not_found", f"adapter {adapter_id!r} has no version {number} (versions: {have})")
    return entry


def deprecate_change(
    adapter_id: str, number: int | None, deprecated: bool
) -> Callable[[dict[str, str]], tuple[Writes, tuple[CatalogEntry, bool]]]:
    """Mark an id (number None) or one version deprecated (or not): (the entry, whether it changed)."""

    def change(fields: dict[str, str]) -> tuple[Writes, tuple[CatalogEntry, bool]]:
        entry = _found(parse_entries(fields), adapter_id, number)
        if number is None:
            updated = replace(entry, deprecated=deprecated)
        else:
            versions = tuple(replace(v, deprecated=deprecated) if v.version == number else v for v in entry.versions)
            updated = replace(entry, versions=versions)
        if updated == entry:
            return {}, (entry, False)
        return {adapter_id: updated.dumps()}, (updated, True)

    return change


def delete_change(adapter_id: str, number: int | None) -> Callable[[dict[str, str]], tuple[Writes, CatalogEntry]]:
    """Delete an id (number None) or one version; what remains (a tombstone when no version does)."""

    def change(fields: dict[str, str]) -> tuple[Writes, CatalogEntry]:
        entry = _found(parse_entries(fields), adapter_id, number)
        kept = () if number is None else tuple(v for v in entry.versions if v.version != number)
        updated = replace(entry, versions=kept, deprecated=entry.deprecated and bool(kept))
        return {adapter_id: updated.dumps()}, updated

    return change


class AdapterCatalog:
    """The catalog as this replica serves it: a snapshot of the store, and the writes that change it."""

    def __init__(self, store: CatalogStore, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self._clock = clock
        self._raw: dict[str, str] = {}
        self.entries: dict[str, CatalogEntry] = {}  # tombstones included
        self._writes = 0  # this replica's writes so far: a read that overlapped one is stale
        self._failing = False

    # ---- the snapshot ----

    async def refresh(self) -> None:
        """Read the store again; while it is unreachable, keep serving the last snapshot."""
        writes = self._writes
        try:
            fields = await self.store.read()
        except UNREACHABLE as exc:
            if not self._failing:
                logger.warning("adapter catalog: the store is unreachable, serving the last snapshot: %s", exc)
            self._failing = True
            return
        self._failing = False
        if writes == self._writes:
            self._take(fields)

    def _take(self, fields: dict[str, str]) -> None:
        entries = {name: e for name, e in self.entries.items() if self._raw.get(name) == fields.get(name)}
        entries.update(parse_entries({name: text for name, text in fields.items() if name not in entries}))
        self._raw, self.entries = fields, entries

    async def _transact(self, change: Callable[[dict[str, str]], tuple[Writes, Any]]) -> Any:
        fields, result = await self.store.transact(change)
        self._writes += 1
        self._take(fields)
        return result

    # ---- reading (the request path: no I/O) ----

    def get(self, adapter_id: str) -> CatalogEntry | None:
        entry = self.entries.get(adapter_id)
        return entry if entry is not None and entry.versions else None

    def resolve(self, name: str) -> Pinned | None:
        """The version a request naming `ID` or `ID@N` gets; None when `name` is no catalog id (the engines
        decide); 404 for a version the id does not have."""
        ref = split_ref(name)
        if ref is None:
            return None
        entry = self.get(ref[0])
        if entry is None:
            return None
        number = ref[1]
        version = entry.current() if number is None else entry.version(number)
        if version is None:
            have = ", ".join(str(v.version) for v in entry.versions)
            raise ApiError(404, "adapter_not_found", f"adapter {entry.id!r} has no version {number} (versions: {have})")
        return Pinned(f"{entry.id}@{version.version}", version, entry.deprecated or version.deprecated)

    def listed(self, tenant: str | None = None, namespace: str | None = None) -> list[CatalogEntry]:
        """Live entries by id: all, or those of `tenant`, or those whose ids are in `namespace/`."""
        entries = live(self.entries.values())
        if tenant is not None:
            entries = [e for e in entries if e.tenant == tenant]
        if namespace is not None:
            entries = [e for e in entries if e.id.startswith(f"{namespace}/")]
        return sorted(entries, key=lambda e: e.id)

    def served(self, engines: frozenset[str]) -> frozenset[str]:
        """What a rollout variant may name: the engines' adapters, the catalog's ids and `ID@N`s (empty while
        no engine has answered, so nothing is checked then)."""
        if not engines:
            return engines
        refs = {e.id for e in live(self.entries.values())}
        refs.update(f"{e.id}@{v.version}" for e in live(self.entries.values()) for v in e.versions)
        return engines | refs

    def counts(self) -> dict[str, int]:
        """Catalog versions by state, for the metrics."""
        out = {"active": 0, "deprecated": 0}
        for entry in live(self.entries.values()):
            for version in entry.versions:
                out[entry.state(version)] += 1
        return out

    # ---- writing ----

    async def register(self, reg: Registration, quota: Quota | None) -> tuple[CatalogEntry, AdapterVersion, bool]:
        result: tuple[CatalogEntry, AdapterVersion, bool] = await self._transact(
            register_change(reg, quota, self._clock())
        )
        return result

    async def deprecate(self, adapter_id: str, number: int | None, deprecated: bool) -> tuple[CatalogEntry, bool]:
        result: tuple[CatalogEntry, bool] = await self._transact(deprecate_change(adapter_id, number, deprecated))
        return result

    async def delete(self, adapter_id: str, number: int | None) -> CatalogEntry:
        result: CatalogEntry = await self._transact(delete_change(adapter_id, number))
        return result

    async def aclose(self) -> None:
        await self.store.aclose()
