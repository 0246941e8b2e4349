"""Which engine holds which prompt prefix: `PrefixIndex`, the memory of prefix-aware routing and session
affinity.

A request's prompt is a chain of chunk hashes (loragate_common/prefix.py: keyed by adapter, each hash naming
all the text before it). When a request has been sent to an engine, the index records each of its hashes (and
its session's key) at that engine; routing asks, per engine, how many leading hashes of a new request it holds
(`Hints`), and admission (gateway/admission.py) sends the request to the longest match within the
bounded-load rule.

What an engine holds is known two ways:
- recorded: the requests this replica, and with Redis every replica, sent there. This replica keeps the
  last `index_entries` hashes in an LRU; Redis keeps each as a hash `loragate:prefix:<hash>` of url -> when
  (unix seconds), expiring `ttl_s` after it was last written. A record Redis already holds for that engine is
  written again only once it is `ttl_s` / 4 old, so a prompt head that every request carries costs Redis a
  read per request and a write per chunk every `ttl_s` / 4, and never expires while in use. Engines that
  report nothing (another kind of server) are known this way only, approximately: their cache may have
  evicted what was sent there.
- reported: a loragate engine's GET /load lists the hashes its prefix cache still holds (`prefixes`, polled
  every second by gateway/fleet.py). For such an engine a recorded hash counts only if it is in its last
  report or was recorded after that report was made (less REPORT_GRACE_S: a request queued or computing
  there is not in the report yet), so the index follows evictions and restarts.

Redis is only a shared memory here: a lookup or record that fails (Redis down, its breaker open) uses this
replica's own records and counts in `redis_errors`; routing never waits on Redis beyond its socket timeout.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.policy import PrefixRouting
from gateway.redis_client import RedisBreaker, redis_client
from loragate_common.prefix import PromptChunks, prompt_chunks, session_hash

logger = logging.getLogger(__name__)

KEY_PREFIX = "loragate:prefix:"
REPORT_FRESH_S = 5.0  # an engine's report older than this is not trusted over the records
REPORT_GRACE_S = 10.0  # records this much older than a report, and missing from it, are taken as evicted
# A shared record younger than this part of ttl_s is not written again: a hot system prompt costs Redis one
# write per chunk every ttl_s / 4 however many requests carry it, and a key in use never expires.
REWRITE_AFTER = 0.25


@dataclass(frozen=True, slots=True)
class Hints:
    """Where a request's prefix and session are held: the leading chunks each engine holds (by url), and
    the engine its session's last request went to."""

    matches: Mapping[str, int] = field(default_factory=dict)
    session: str | None = None
    # What Redis held for each key looked up (the chunk hashes, then the session): url -> when recorded.
    shared: tuple[Mapping[str, float], ...] = ()

    def match(self, url: str) -> int:
        return self.matches.get(url, 0)

    @property
    def best(self) -> int:
        return max(self.matches.values(), default=0)


NO_HINTS = Hints()


@dataclass(slots=True)
class _Report:
    hashes: frozenset[str]
    at: float  # unix seconds when it was received


class RedisPrefixStore:
    """The replicas' shared records: one Redis hash per chunk hash, url -> unix seconds."""

    def __init__(self, url: str) -> None:
        self._redis = redis_client(url)

    @property
    def breaker(self) -> RedisBreaker:
        return self._redis.breaker

    async def get(self, keys: Sequence[str]) -> list[dict[str, float]]:
        async with self._redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hgetall(KEY_PREFIX + key)
            answers = await pipe.execute()
        return [{str(url): float(at) for url, at in answer.items()} for answer in answers]

    async def put(self, url: str, keys: Sequence[str], at: float, ttl_s: int) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hset(KEY_PREFIX + key, url, f"{at:.3f}")
                pipe.expire(KEY_PREFIX + key, ttl_s)
            await pipe.execute()

    async def aclose(self) -> None:
        await self._redis.aclose()


class PrefixIndex:
    def __init__(
        self,
        settings: PrefixRouting,
        session_key: str,
        store: RedisPrefixStore | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.session_key = session_key
        self.store = store
        self._clock = clock
        self._records: OrderedDict[str, dict[str, float]] = OrderedDict()  # hash -> url -> when; LRU first
        self._reports: dict[str, _Report] = {}
        self.counts: Counter[str] = Counter()  # routing outcomes, by "prefix_<x>" / "session_<x>"
        self.redis_errors = 0

    def configure(self, settings: PrefixRouting, session_key: str) -> None:
        """A reloaded policy's settings; a smaller index drops its oldest records now."""
        self.settings, self.session_key = settings, session_key
        self._trim()

    # ---- what a request is ----

    def chunks(self, body: Mapping[str, Any], chat: bool, adapter: str | None) -> PromptChunks | None:
        """The request's prompt chunks under `adapter`; None with prefix routing off or no single prompt."""
        s = self.settings
        if not s.enabled:
            return None
        return prompt_chunks(body, chat, adapter, s.chunk_chars, s.max_chunks)

    def session(self, tenant: str, headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
        """The index key of the request's session (the policy's `session_key`), or None."""
        how = self.session_key
        value: object = None
        if how.startswith("header:"):
            value = headers.get(how[7:])
        elif how == "body:user":
            value = body.get("user")
        return session_hash(tenant, value) if isinstance(value, str) and value else None

    # ---- reading and writing ----

    async def lookup(self, chunks: PromptChunks | None, session: str | None) -> Hints:
        """Where the request's leading chunks and its session are held."""
        keys = list(chunks.hashes) if chunks is not None else []
        if session is not None:
            keys.append(session)
        if not keys:
            return NO_HINTS
        found = [self._records.get(key, {}) for key in keys]
        shared: list[dict[str, float]] = []
        if self.store is not None:
            try:
                shared = await self.store.get(keys)
            except Exception as exc:  # noqa: BLE001 - any Redis failure leaves this replica's own records
                self._redis_failed("reading", exc)
            else:
                found = [{**mine, **theirs} for mine, theirs in zip(found, shared, strict=True)]
        now = self._clock()
        matches: dict[str, int] = {}
        if chunks is not None and chunks.hashes:
            reporting = {url for url, r in self._reports.items() if chunks.hashes[0] in r.hashes}
            for url in reporting.union(*found[: len(chunks.hashes)]):
                n = 0
                while n < len(chunks.hashes) and self._holds(url, chunks.hashes[n], found[n].get(url), now):
                    n += 1
                if n:
                    matches[url] = n
        where = found[-1] if session is not None else {}
        return Hints(matches, max(where, key=lambda url: where[url]) if where else None, tuple(shared))

    async def record(self, url: str, chunks: PromptChunks | None, session: str | None, hints: Hints = NO_HINTS) -> None:
        """`url` received a request with these chunks and session (`hints`: what `lookup` found for them)."""
        keys = list(chunks.hashes) if chunks is not None else []
        if session is not None:
            keys.append(session)
        if not keys:
            return
        now = self._clock()
        for key in keys:
            where = self._records.pop(key, None) or {}
            where[url] = now
            self._records[key] = where
        self._trim()
        if self.store is not None:
            recent = now - REWRITE_AFTER * self.settings.ttl_s
            none: Mapping[str, float] = {}
            seen = hints.shared if len(hints.shared) == len(keys) else (none,) * len(keys)
            stale = [key for key, where in zip(keys, seen, strict=True) if where.get(url, -math.inf) <= recent]
            if not stale:
                return
            try:
                await self.store.put(url, stale, now, self.settings.ttl_s)
            except Exception as exc:  # noqa: BLE001
                self._redis_failed("writing", exc)

    def report(self, url: str, hashes: Sequence[str]) -> None:
        """An engine's own list of the hashes its prefix cache holds (GET /load's `prefixes`)."""
        self._reports[url] = _Report(frozenset(hashes[: self.settings.index_entries]), self._clock())

    def forget(self, urls: Sequence[str]) -> None:
        """Engines that left the fleet: their reports go (their records age out of the LRU)."""
        for url in urls:
            self._reports.pop(url, None)

    def _holds(self, url: str, key: str, recorded_at: float | None, now: float) -> bool:
        report = self._reports.get(url)
        if report is None or now - report.at > REPORT_FRESH_S:
            return recorded_at is not None
        return key in report.hashes or (recorded_at is not None and recorded_at > report.at - REPORT_GRACE_S)

    def _trim(self) -> None:
        while len(self._records) > self.settings.index_entries:
            self._records.popitem(last=False)

    def _redis_failed(self, doing: str, exc: Exception) -> None:
        if not self.redis_errors:
            logger.warning("prefix index: %s Redis failed (this replica's records only): %s", doing, exc)
        self.redis_errors += 1

    # ---- outcomes ----

    def count(self, hints: Hints, url: str, chunks: PromptChunks | None, session: str | None) -> None:
        """Count where a request went against its hints: for a prompt of one chunk or more, a prefix `hit`
        (an engine with the longest match), `miss` (no engine held any of it) or `overridden` (the longest
        match was past the load bound); for a request with a session, a session `hit`, `new` (its first
        request) or `overridden` (its engine was past the load bound, or held less of the prefix than
        another)."""
        if chunks is not None and chunks.hashes:
            best = hints.best
            outcome = "miss" if not best else "hit" if hints.match(url) == best else "overridden"
            self.counts[f"prefix_{outcome}"] += 1
        if session is not None:
            outcome = "new" if hints.session is None else "hit" if hints.session == url else "overridden"
            self.counts[f"session_{outcome}"] += 1

    def describe(self) -> dict[str, Any]:
        """For GET /admin/policy and the metrics."""
        s = self.settings
        return {
            "enabled": s.enabled,
            "session_key": self.session_key,
            "entries": len(self._records),
            "index_entries": s.index_entries,
            "shared": self.store is not None,
            "redis_errors": self.redis_errors,
            "reported": {url: len(r.hashes) for url, r in sorted(self._reports.items())},
            "outcomes": dict(sorted(self.counts.items())),
        }

    async def aclose(self) -> None:
        if self.store is not None:
            await self.store.aclose()
