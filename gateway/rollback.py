"""A rollout variant's health: its sliding window of outcomes (`Window`), the pooled `Counts` the
replicas add up, and the `verdict` that rolls a rollout back (`RollbackEvent`), as gateway/rollout.py
uses them.

A variant is judged on its requests in the last `rollback.window_s`: its error rate against
`max_error_rate`, and the nearest-rank p99 of its time to first token against `max_ttft_p99_ms`, once it has
`min_requests`.
"""

from __future__ import annotations

import bisect
import json
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from gateway.clock import iso_time
from gateway.policy import Rollback
from loragate_common.stats import nearest_rank


@dataclass(frozen=True, slots=True)
class RollbackEvent:
    """Why and when a rollout was sent back to its first variant."""

    variant: str  # the variant that broke a bound
    reason: str  # "error_rate" or "ttft_p99"
    detail: str  # e.g. "error rate 0.120 > 0.05 over 100 requests in 60 s"
    at: float  # wall-clock time

    def to_json(self) -> dict[str, Any]:
        return {"variant": self.variant, "reason": self.reason, "detail": self.detail, "at": iso_time(self.at)}

    def dumps(self) -> str:
        return json.dumps({"variant": self.variant, "reason": self.reason, "detail": self.detail, "at": self.at})

    @classmethod
    def loads(cls, text: str) -> RollbackEvent | None:
        try:
            d = json.loads(text)
            return cls(str(d["variant"]), str(d["reason"]), str(d["detail"]), float(d["at"]))
        except (ValueError, KeyError, TypeError):
            return None


@dataclass(slots=True)
class Counts:
    """One variant's outcomes: requests, errors, and of the successes with a TTFT (`timed`) those slower than
    the rollout's `max_ttft_p99_ms` (`slow`).

    The nearest-rank p99 of `timed` values is above the bound exactly when more than
    `timed - ceil(0.99 * timed)` of them are slow, so the test needs only counts, and counts add up across
    replicas (the fleet-wide windows in Redis hold these four numbers).
    """

    requests: int = 0
    errors: int = 0
    timed: int = 0
    slow: int = 0

    FIELDS = ("requests", "errors", "timed", "slow")

    def add(self, other: Counts) -> None:
        self.requests += other.requests
        self.errors += other.errors
        self.timed += other.timed
        self.slow += other.slow

    def fields(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.FIELDS if getattr(self, name)}

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> Counts:
        return cls(*(int(fields.get(name) or 0) for name in cls.FIELDS))

    def p99_above_bound(self) -> bool:
        return self.timed > 0 and self.slow > self.timed - math.ceil(0.99 * self.timed)


def verdict(bounds: Rollback, variant: str, counts: Counts, wall: float, scope: str = "") -> RollbackEvent | None:
    """The rollback `counts` call for (None below min_requests or within the bounds)."""
    n = counts.requests
    if n < bounds.min_requests:
        return None
    span = f"over {n} requests in {bounds.window_s:g} s{scope}"
    if counts.errors / n > bounds.max_error_rate:
        return RollbackEvent(
            variant, "error_rate", f"error rate {counts.errors / n:.3f} > {bounds.max_error_rate:g} {span}", wall
        )
    if counts.p99_above_bound():
        return RollbackEvent(
            variant,
            "ttft_p99",
            f"TTFT p99 > {bounds.max_ttft_p99_ms:g} ms ({counts.slow} of {counts.timed} slower) {span}",
            wall,
        )
    return None


class Window:
    """One variant's outcomes over the last `span_s` seconds on this replica (TTFTs kept sorted)."""

    def __init__(self, span_s: float) -> None:
        self.span_s = span_s
        self.clear()

    def clear(self) -> None:
        self._events: deque[tuple[float, bool, float | None]] = deque()  # (at, error, ttft_s)
        self._ttfts: list[float] = []  # sorted
        self.errors = 0

    def add(self, now: float, error: bool, ttft_s: float | None) -> None:
        self._expire(now)
        self._events.append((now, error, ttft_s))
        self.errors += error
        if ttft_s is not None:
            bisect.insort(self._ttfts, ttft_s)

    def counts(self, now: float, bound_ms: float) -> Counts:
        self._expire(now)
        slow = len(self._ttfts) - bisect.bisect_right(self._ttfts, bound_ms / 1000)
        return Counts(len(self._events), self.errors, len(self._ttfts), slow)

    def stats(self, now: float) -> tuple[int, int, float | None]:
        """(requests, errors, p99 TTFT in seconds or None) in the window ending at `now`."""
        self._expire(now)
        return len(self._events), self.errors, self.p99()

    def p99(self) -> float | None:
        if not self._ttfts:
            return None
        return nearest_rank(self._ttfts, 0.99)

    def _expire(self, now: float) -> None:
        while self._events and self._events[0][0] <= now - self.span_s:
            _, error, ttft = self._events.popleft()
            self.errors -= error
            if ttft is not None:
                del self._ttfts[bisect.bisect_left(self._ttfts, ttft)]
