"""One adapter id's catalog entry (gateway/adapter_catalog.py): its versions, each pinned to a source and a
digest, and how an entry is stored (JSON, one Redis hash field per id) and shown (the admin API).

An entry without versions is a tombstone: a deleted id keeps its next version number, so a number once given is
never given again.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gateway.clock import iso_time
from loragate_common.errors import bad_request

logger = logging.getLogger(__name__)

_SHA256_RE = re.compile(r"[0-9a-f]{64}")


def check_sha256(value: Any, field: str = "sha256") -> str:
    if not isinstance(value, str) or _SHA256_RE.fullmatch(value.strip().lower()) is None:
        raise bad_request(f"{field}: must be a sha256 digest, 64 hex digits")
    return value.strip().lower()


@dataclass(frozen=True, slots=True)
class AdapterVersion:
    version: int
    source: str  # normalised (loragate_common.adapter_sources.parse_source)
    sha256: str  # the archive's digest (https, http) or the content digest of the two adapter files
    size: int | None  # bytes of the two adapter files, when declared (the engine checks it)
    revision: str | None  # what the publisher named (an hf revision), when any
    published_by: str  # a tenant id, or "admin:<key fingerprint>"
    published_at: float  # unix seconds
    deprecated: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "source": self.source,
            "sha256": self.sha256,
            "size": self.size,
            "revision": self.revision,
            "published_by": self.published_by,
            "published_at": self.published_at,
            "deprecated": self.deprecated,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AdapterVersion:
        return cls(
            version=int(data["version"]),
            source=str(data["source"]),
            sha256=str(data["sha256"]),
            size=None if data.get("size") is None else int(data["size"]),
            revision=None if data.get("revision") is None else str(data["revision"]),
            published_by=str(data["published_by"]),
            published_at=float(data["published_at"]),
            deprecated=bool(data.get("deprecated", False)),
        )


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    id: str
    tenant: str | None  # the namespace owner (None: the operators')
    versions: tuple[AdapterVersion, ...]  # oldest first; empty: a deleted id's tombstone
    next_version: int
    deprecated: bool = False

    def current(self) -> AdapterVersion:
        """What `ID` alone serves: the newest version not deprecated (all deprecated: the newest)."""
        assert self.versions, "a tombstone has no versions"
        return next((v for v in reversed(self.versions) if not v.deprecated), self.versions[-1])

    def version(self, number: int) -> AdapterVersion | None:
        return next((v for v in self.versions if v.version == number), None)

    def state(self, version: AdapterVersion) -> str:
        return "deprecated" if self.deprecated or version.deprecated else "active"

    def dumps(self) -> str:
        data = {
            "id": self.id,
            "tenant": self.tenant,
            "deprecated": self.deprecated,
            "next_version": self.next_version,
            "versions": [v.to_json() for v in self.versions],
        }
        return json.dumps(data, separators=(",", ":"), sort_keys=True)

    @classmethod
    def loads(cls, text: str) -> CatalogEntry:
        data = json.loads(text)
        versions = tuple(AdapterVersion.from_json(v) for v in data["versions"])
        newest = max((v.version for v in versions), default=0)
        return cls(
            id=str(data["id"]),
            tenant=None if data.get("tenant") is None else str(data["tenant"]),
            versions=versions,
            next_version=max(int(data.get("next_version", 1)), newest + 1),
            deprecated=bool(data.get("deprecated", False)),
        )

    def describe(self, engines: Callable[[str], dict[str, Any]] | None = None) -> dict[str, Any]:
        """The entry as the admin API shows it; `engines(ref)`: that version's state on each engine."""
        versions = []
        for v in self.versions:
            shown_version = {
                **v.to_json(),
                "ref": f"{self.id}@{v.version}",
                "published_at": iso_time(v.published_at),
                "state": self.state(v),
            }
            if engines is not None:
                shown_version["engines"] = engines(f"{self.id}@{v.version}")
            versions.append(shown_version)
        return {
            "id": self.id,
            "tenant": self.tenant,
            "deprecated": self.deprecated,
            "current": self.current().version if self.versions else None,
            "versions": versions,
        }


def parse_entries(fields: dict[str, str]) -> dict[str, CatalogEntry]:
    """The stored fields as entries; an unreadable one is logged and left out."""
    entries = {}
    for name, text in fields.items():
        try:
            entries[name] = CatalogEntry.loads(text)
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("adapter catalog: ignoring the unreadable entry %r: %s", name, exc)
    return entries


def live(entries: Iterable[CatalogEntry]) -> list[CatalogEntry]:
    """The entries that are not tombstones."""
    return [e for e in entries if e.versions]
