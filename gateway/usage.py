"""The usage ledger: one record per finished request, for billing and capacity planning.

`Generate` (gateway/generate.py) records each request once, when it has finished however it ended: its
tenant, adapter (and version, when the id names one as `ID@version`), the rollout that routed it, prompt and
completion tokens, HTTP status, priority, latency and trace id. A mix of adapters is recorded under its canonical
name (loragate_common/adapter_mix.py `mix_name`, version ""), with its parts as they were served: `parts`, a list
of {"adapter": ref, "weight": w} (and "rollout" for a part a rollout chose), and the rollouts of its parts
joined by '+'. A retry inside the gateway is the same request (one record); a stream cut by a client disconnect
records the tokens that were sent (its prompt tokens then are the engine's count if it reported one, else the
gateway's estimate).

Recording never waits on Redis: a record goes into a bounded in-memory buffer, and `flush()` (the
housekeeping round, about once a second, and the app's shutdown) writes the buffer to the shared store.
While Redis is unreachable the records wait in the buffer (up to `max_pending`; past it the oldest are
dropped and counted), and are written once it is back. Each record carries a request id, and reading
drops repeats, so a write that succeeded but whose answer was lost, then written again, counts once.

`RedisUsageLedger` keeps the records in a Redis Stream (`loragate:usage`) trimmed to about `retention`
entries (XADD MAXLEN ~), shared by every gateway replica; `MemoryUsageLedger` keeps them in this process
(one gateway without `--redis`). `aggregate` sums records by any of `USAGE_KEYS`: what GET /admin/usage and
`loragate usage` answer.
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

from gateway.redis_client import UNREACHABLE, redis_client

logger = logging.getLogger(__name__)

USAGE_KEYS = ("tenant", "adapter", "version", "rollout", "priority", "status", "day", "month")
TOTALS = ("requests", "prompt_tokens", "completion_tokens")
MAX_PENDING = 100_000  # records buffered while the store is unreachable
RETENTION = 1_000_000  # records kept in the stream (about: MAXLEN ~)
FLUSH_BATCH = 500


@dataclass(frozen=True, slots=True)
class UsageRecord:
    request_id: str
    at: float  # wall-clock time the request finished
    tenant: str
    adapter: str  # the adapter served, or the base model's name
    version: str  # the `@version` part of the adapter id, "" when it names none
    rollout: str  # the rollout that chose the adapter, "" when none did
    prompt_tokens: int
    completion_tokens: int
    status: int
    priority: str
    latency_ms: float
    trace_id: str  # "" without a sampled trace
    parts: tuple[dict[str, Any], ...] = ()  # a mix's: {"adapter": ref, "weight": w[, "rollout": name]}, by ref

    def to_fields(self) -> dict[str, str]:
        fields = {name: str(value) for name, value in asdict(self).items() if name != "parts"}
        if self.parts:
            fields["parts"] = json.dumps(list(self.parts))
        return fields

    @classmethod
    def from_fields(cls, data: dict[str, str]) -> UsageRecord | None:
        """A record read back; None for an entry that is not one (a foreign or damaged stream entry)."""
        try:
            return cls(
                request_id=data["request_id"],
                at=float(data["at"]),
                tenant=data["tenant"],
                adapter=data["adapter"],
                version=data.get("version", ""),
                rollout=data.get("rollout", ""),
                prompt_tokens=int(data["prompt_tokens"]),
                completion_tokens=int(data["completion_tokens"]),
                status=int(data["status"]),
                priority=data.get("priority", ""),
                latency_ms=float(data.get("latency_ms", 0)),
                trace_id=data.get("trace_id", ""),
                parts=_parts(data.get("parts")),
            )
        except (KeyError, ValueError):
            return None

    def key(self, name: str) -> str | int:
        """The value of one `USAGE_KEYS` grouping key."""
        if name == "day":
            return datetime.fromtimestamp(self.at, timezone.utc).strftime("%Y-%m-%d")
        if name == "month":
            return datetime.fromtimestamp(self.at, timezone.utc).strftime("%Y-%m")
        value: str | int = getattr(self, name)
        return value


def _parts(text: str | None) -> tuple[dict[str, Any], ...]:
    """A record's `parts` read back: a JSON list of objects (ValueError for anything else)."""
    if not text:
        return ()
    parts = json.loads(text)
    if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
        raise ValueError("parts: not a list of objects")
    return tuple(parts)


def parse_when(text: str, now: float) -> float:
    """A time in a usage query, as wall-clock seconds: an ISO 8601 date or date-time (UTC unless it says
    otherwise: `2026-12-01`, `2026-12-01T09:30`, `2026-12-01T09:30:00+01:00`), a time that far back (`90m`,
    `24h`, `7d`), or seconds since the epoch. ValueError, saying what is accepted, for anything else."""
    text = text.strip()
    units = {"m": 60, "h": 3600, "d": 86400}
    if len(text) > 1 and text[-1] in units and text[:-1].isdigit():
        return now - int(text[:-1]) * units[text[-1]]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"{text[:40]!r} is not a time: give an ISO 8601 date or date-time (2026-12-01, 2026-12-01T09:30Z), "
            "a span back from now (90m, 24h, 7d) or epoch seconds"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.timestamp()


def month_start(now: float) -> float:
    t = datetime.fromtimestamp(now, timezone.utc)
    return datetime(t.year, t.month, 1, tzinfo=timezone.utc).timestamp()


def day_start(now: float) -> float:
    t = datetime.fromtimestamp(now, timezone.utc)
    return datetime(t.year, t.month, t.day, tzinfo=timezone.utc).timestamp()


def split_version(adapter: str) -> tuple[str, str]:
    """`ID@version` -> (ID, version); an id without `@` has version ""."""
    name, _, version = adapter.partition("@")
    return name, version


def aggregate(records: Iterable[UsageRecord], by: Sequence[str]) -> list[dict[str, Any]]:
    """Rows of totals (`TOTALS`) per distinct value of the `by` keys, sorted by those keys; each record once
    (by request id). `by` empty: one row with the grand totals."""
    unknown = [key for key in by if key not in USAGE_KEYS]
    if unknown:
        raise ValueError(f"unknown grouping key {unknown[0]!r} (one of: {', '.join(USAGE_KEYS)})")
    seen: set[str] = set()
    rows: dict[tuple[str | int, ...], list[int]] = {}
    for record in records:
        if record.request_id in seen:
            continue
        seen.add(record.request_id)
        totals = rows.setdefault(tuple(record.key(k) for k in by), [0, 0, 0])
        totals[0] += 1
        totals[1] += record.prompt_tokens
        totals[2] += record.completion_tokens
    if not by and not rows:
        rows[()] = [0, 0, 0]
    return [
        {**dict(zip(by, key, strict=True)), **dict(zip(TOTALS, totals, strict=True))}
        for key, totals in sorted(rows.items(), key=lambda item: tuple(str(v) for v in item[0]))
    ]


class UsageLedger(ABC):
    """The buffer every ledger shares; subclasses say where records go (`_write`) and come from (`read`)."""

    shared = False

    def __init__(self, max_pending: int = MAX_PENDING) -> None:
        self.pending: deque[UsageRecord] = deque()
        self.max_pending = max_pending
        self.recorded = 0  # records taken since start
        self.dropped = 0  # records lost because the buffer was full (the store unreachable for that long)
        self._failing = False

    def record(self, record: UsageRecord) -> None:
        """Take one finished request's record; never blocks."""
        self.recorded += 1
        if len(self.pending) >= self.max_pending:
            self.pending.popleft()
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.error("usage ledger buffer full: %d records dropped so far", self.dropped)
        self.pending.append(record)

    async def flush(self) -> int:
        """Write what is buffered, in batches; returns how many were written. A batch that fails stays
        buffered, at the front, for the next flush."""
        written = 0
        while self.pending:
            batch = [self.pending[i] for i in range(min(FLUSH_BATCH, len(self.pending)))]
            try:
                await self._write(batch)
            except UNREACHABLE as exc:
                if not self._failing:
                    logger.warning("usage ledger: store unreachable, %d records buffered: %s", len(self.pending), exc)
                self._failing = True
                return written
            for _ in batch:
                self.pending.popleft()
            written += len(batch)
        if self._failing:
            logger.info("usage ledger: store reachable again, buffer written")
        self._failing = False
        return written

    @abstractmethod
    async def _write(self, batch: list[UsageRecord]) -> None: ...

    @abstractmethod
    async def read(self, since: float, until: float) -> list[UsageRecord]:
        """The written records that finished in [since, until) (wall-clock seconds), plus this replica's
        still-buffered ones."""

    def _buffered(self, since: float, until: float) -> list[UsageRecord]:
        return [r for r in self.pending if since <= r.at < until]

    async def aclose(self) -> None:
        return None


class MemoryUsageLedger(UsageLedger):
    """This process's records only, the newest `retention` kept."""

    def __init__(self, retention: int = RETENTION, max_pending: int = MAX_PENDING) -> None:
        super().__init__(max_pending)
        self.records: deque[UsageRecord] = deque(maxlen=retention)

    async def _write(self, batch: list[UsageRecord]) -> None:
        self.records.extend(batch)

    async def read(self, since: float, until: float) -> list[UsageRecord]:
        return [r for r in self.records if since <= r.at < until] + self._buffered(since, until)


class RedisUsageLedger(UsageLedger):
    """Records in one Redis Stream shared by every replica."""

    KEY = "loragate:usage"
    shared = True

    def __init__(self, url: str, retention: int = RETENTION, max_pending: int = MAX_PENDING) -> None:
        super().__init__(max_pending)
        self.retention = retention
        self._redis = redis_client(url)

    async def _write(self, batch: list[UsageRecord]) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for record in batch:
            entry: dict[Any, Any] = record.to_fields()  # redis-py's field type is a union of encodables
            pipe.xadd(self.KEY, entry, maxlen=self.retention, approximate=True)
        await pipe.execute()

    async def read(self, since: float, until: float) -> list[UsageRecord]:
        # A stream id is the time the record was written, never before the request finished: every record
        # that finished at or after `since` has an id at or after it. Records finished before `until` may
        # have been written after it (buffered while Redis was down), so read on to the end and filter.
        found: list[UsageRecord] = []
        start = f"{max(0, int(since * 1000))}-0"
        while True:
            entries = await self._redis.xrange(self.KEY, min=start, max="+", count=10_000) or []
            for _id, data in entries:
                record = UsageRecord.from_fields({str(k): str(v) for k, v in (data or {}).items()})
                if record is not None and since <= record.at < until:
                    found.append(record)
            if len(entries) < 10_000:
                break
            start = "(" + str(entries[-1][0])
        return found + self._buffered(since, until)

    async def aclose(self) -> None:
        await self._redis.aclose()
