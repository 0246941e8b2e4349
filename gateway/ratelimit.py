"""Per-tenant rate limits: a GCRA request limit and a tokens-per-minute bucket, checked together.

Requests (GCRA): emission interval T = 1 / requests_per_second; the state is the theoretical arrival time
`tat`. A request at `now` is admitted when `max(tat, now) + T - burst * T <= now`, which lets `burst`
requests through back to back and then one every T seconds. Admitting sets `tat = max(tat, now) + T`.

Tokens: a bucket of capacity tokens_per_minute refilled at tokens_per_minute / 60 per second. A request
reserves its token estimate up front; `reconcile` later credits back what it did not use (never above
capacity) or debits what it used beyond the reservation (the level may go negative: a debt).

Both checks are one atomic step: when either refuses nothing is debited, and the answer's retry-after is
the wait of the binding (longer) check. `MemoryRateLimiter` keeps the state in-process;
`RedisRateLimiter` (gateway/redis_limiter.py) runs the same arithmetic in one Lua script so that every
gateway replica shares it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from gateway.policy import Limits

# Float slack for "exactly on the boundary" (e.g. the burst-th request of a burst): 1 microsecond / token.
EPS = 1e-6


class RateLimiterUnavailable(Exception):
    """The shared limiter store is unreachable and the policy says to fail closed."""


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    reason: str | None  # "rate_limited" | "tokens_exhausted" | None when allowed
    retry_after_s: float  # 0 when allowed
    limit: int  # the request limit (= burst), for RateLimit-Limit
    remaining: int  # requests the request bucket would still admit right now
    reset_s: float  # seconds until the request bucket is full again


@dataclass(frozen=True, slots=True)
class Reservation:
    tenant: str
    tokens: int
    limits: Limits | None = None  # the limits it was taken under: reconcile needs the bucket's capacity


class RateLimiter(Protocol):
    redis_errors: int
    on_error: Literal["open", "closed"]  # what a store outage means (only a shared store has outages)

    async def acquire(self, tenant: str, limits: Limits, tokens: int) -> tuple[Decision, Reservation | None]: ...

    async def reconcile(self, reservation: Reservation, used_tokens: int) -> None: ...

    async def healthy(self) -> bool: ...

    async def aclose(self) -> None: ...


def refill_per_s(limits: Limits) -> float:
    return limits.tokens_per_minute / 60.0


def decide(limits: Limits, now: float, tat: float, level: float, need: int) -> tuple[Decision, float]:
    """The admission arithmetic (mirrored line by line in redis_limiter's Lua script).

    `tat` is the stored theoretical arrival time (or `now` when none), `level` the token level refilled
    to `now`. Returns (decision, tat after the decision)."""
    interval = 1.0 / limits.requests_per_second
    span = interval * limits.burst
    tat = max(tat, now)
    req_wait = tat + interval - span - now
    req_wait = req_wait if req_wait > EPS else 0.0
    rate = refill_per_s(limits)
    tok_wait = 0.0
    if need > limits.tokens_per_minute:
        tok_wait = 60.0  # never satisfiable: come back after a full refill window
    elif need > level + EPS:
        tok_wait = (need - level) / rate
    if req_wait > 0 or tok_wait > 0:
        reason = "tokens_exhausted" if tok_wait > req_wait else "rate_limited"
        remaining = math.floor((now + span - tat) / interval + EPS)
        return Decision(False, reason, max(req_wait, tok_wait), limits.burst, remaining, tat - now), tat
    tat += interval
    remaining = math.floor((now + span - tat) / interval + EPS)
    return Decision(True, None, 0.0, limits.burst, remaining, tat - now), tat


@dataclass(slots=True)
class _Buckets:
    tat: float  # GCRA theoretical arrival time
    tokens: float  # token level at `stamp` (negative = debt)
    stamp: float

    def level(self, limits: Limits, now: float) -> float:
        return min(float(limits.tokens_per_minute), self.tokens + (now - self.stamp) * refill_per_s(limits))


class MemoryRateLimiter:
    """Single-process limiter; `acquire` never awaits, so on one event loop every step is atomic."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._state: dict[str, _Buckets] = {}
        self.redis_errors = 0
        self.on_error: Literal["open", "closed"] = "open"  # never used: memory does not fail

    async def acquire(self, tenant: str, limits: Limits, tokens: int) -> tuple[Decision, Reservation | None]:
        now = self._clock()
        state = self._state.get(tenant)
        tat = state.tat if state else now
        level = state.level(limits, now) if state else float(limits.tokens_per_minute)
        decision, tat = decide(limits, now, tat, level, tokens)
        if not decision.allowed:
            return decision, None
        self._state[tenant] = _Buckets(tat, level - tokens, now)
        return decision, Reservation(tenant, tokens, limits)

    async def reconcile(self, reservation: Reservation, used_tokens: int) -> None:
        limits = reservation.limits
        if limits is None:
            return
        now = self._clock()
        state = self._state.get(reservation.tenant)
        level = state.level(limits, now) if state else float(limits.tokens_per_minute)
        level = min(float(limits.tokens_per_minute), level + reservation.tokens - used_tokens)
        self._state[reservation.tenant] = _Buckets(state.tat if state else now, level, now)

    async def healthy(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None
