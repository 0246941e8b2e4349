"""The rate limiter shared by gateway replicas: ratelimit.decide's arithmetic in one Lua script per step.

Keys per tenant: `<prefix><tenant>:req` holds the GCRA theoretical arrival time (seconds, Redis clock) and
`<prefix><tenant>:tok` a hash {tokens, ts} (level at ts). The scripts read the clock with TIME, never the
caller's, so replicas agree; each key expires (PX / PEXPIRE) when its bucket would be full again, since a
missing key means exactly "full", so idle tenants leave nothing behind.
"""

from __future__ import annotations

import logging
from typing import Literal

from gateway.policy import Limits
from gateway.ratelimit import Decision, RateLimiterUnavailable, Reservation, refill_per_s
from gateway.redis_client import UNREACHABLE, RedisBreaker, RedisSkipped, redis_client

logger = logging.getLogger(__name__)

_REASONS = {1: "rate_limited", 2: "tokens_exhausted"}

# Shared head: `now` from the Redis clock and the token level of KEYS[tok] refilled to now.
# Numbers go back to Redis through string.format: Lua's default number->string keeps only 14 digits. TTLs round up
# to whole ms after taking off 1 us: `now` (~1.8e9 s as a double) carries ~0.2 us of noise, which made a 200 ms TTL
# 201 ms now and then.
_LEVEL = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function level_of(key, cap, rate)
  local b = redis.call('HMGET', key, 'tokens', 'ts')
  if not b[1] then return cap end
  return math.min(cap, tonumber(b[1]) + (now - tonumber(b[2])) * rate)
end
local function store_level(key, level, cap, rate)
  if level >= cap then redis.call('DEL', key) return end
  redis.call('HSET', key, 'tokens', string.format('%.17g', level), 'ts', string.format('%.17g', now))
  redis.call('PEXPIRE', key, string.format('%d', math.max(1, math.ceil((cap - level) / rate * 1000 - 0.001))))
end
"""

# KEYS: req, tok. ARGV: interval_s, burst, capacity, refill_per_s, need.
# Returns {allowed 0|1, reason 0|1|2, retry_after_s, remaining, reset_s}; floats as strings (Lua numbers
# come back to the client as truncated integers).
_ACQUIRE = (
    _LEVEL
    + """
local interval, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local cap, rate, need = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local eps = 1e-6
local span = interval * burst
local tat = tonumber(redis.call('GET', KEYS[1])) or now
if tat < now then tat = now end
local req_wait = tat + interval - span - now
if req_wait <= eps then req_wait = 0 end
local level = level_of(KEYS[2], cap, rate)
local tok_wait = 0
if need > cap then tok_wait = 60
elseif need > level + eps then tok_wait = (need - level) / rate end
if req_wait > 0 or tok_wait > 0 then
  local reason = 1
  if tok_wait > req_wait then reason = 2 end
  local remaining = math.floor((now + span - tat) / interval + eps)
  return {0, reason, string.format('%.17g', math.max(req_wait, tok_wait)), remaining,
          string.format('%.17g', tat - now)}
end
tat = tat + interval
redis.call('SET', KEYS[1], string.format('%.17g', tat), 'PX',
           string.format('%d', math.max(1, math.ceil((tat - now) * 1000 - 0.001))))
store_level(KEYS[2], level - need, cap, rate)
return {1, 0, '0', math.floor((now + span - tat) / interval + eps), string.format('%.17g', tat - now)}
"""
)

# KEYS: tok. ARGV: capacity, refill_per_s, delta (reserved - used; negative debits over-use).
_RECONCILE = (
    _LEVEL
    + """
local cap, rate, delta = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
store_level(KEYS[1], math.min(cap, level_of(KEYS[1], cap, rate) + delta), cap, rate)
return 0
"""
)


class RedisRateLimiter:
    """GCRA + token bucket in Redis. on_error: "open" admits while Redis is unreachable, "closed" raises
    RateLimiterUnavailable; either way `redis_errors` counts the failures (calls the Redis breaker
    skipped included: gateway/redis_client.py)."""

    def __init__(self, url: str, on_error: Literal["open", "closed"] = "open", prefix: str = "loragate:rl:") -> None:
        if on_error not in ("open", "closed"):
            raise ValueError(f"on_error must be 'open' or 'closed', not {on_error!r}")
        self.on_error = on_error
        self.prefix = prefix
        self.redis_errors = 0
        self._redis = redis_client(url)
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._reconcile = self._redis.register_script(_RECONCILE)

    @property
    def breaker(self) -> RedisBreaker:
        """The breaker in front of this limiter's Redis (shared with every client of the same URL)."""
        return self._redis.breaker

    def keys(self, tenant: str) -> tuple[str, str]:
        """(request key, token key) of a tenant."""
        return f"{self.prefix}{tenant}:req", f"{self.prefix}{tenant}:tok"

    async def acquire(self, tenant: str, limits: Limits, tokens: int) -> tuple[Decision, Reservation | None]:
        args = (
            repr(1.0 / limits.requests_per_second),
            limits.burst,
            limits.tokens_per_minute,
            repr(refill_per_s(limits)),
            tokens,
        )
        try:
            allowed, reason, retry_after, remaining, reset = await self._acquire(self.keys(tenant), args)
        except UNREACHABLE as exc:
            self._failed("acquire", exc)
            # Fail open: admit, and reserve nothing (reconcile then debits whatever was used, if it can).
            return Decision(True, None, 0.0, limits.burst, limits.burst, 0.0), Reservation(tenant, 0, limits)
        decision = Decision(
            bool(allowed), _REASONS.get(int(reason)), float(retry_after), limits.burst, int(remaining), float(reset)
        )
        return decision, Reservation(tenant, tokens, limits) if decision.allowed else None

    async def reconcile(self, reservation: Reservation, used_tokens: int) -> None:
        """Best effort in both modes: the response has already been served."""
        limits = reservation.limits
        if limits is None:
            return
        args = (limits.tokens_per_minute, repr(refill_per_s(limits)), reservation.tokens - used_tokens)
        try:
            await self._reconcile(self.keys(reservation.tenant)[1:], args)
        except UNREACHABLE as exc:
            self.redis_errors += 1
            log = logger.debug if isinstance(exc, RedisSkipped) else logger.warning
            log("rate limiter: reconcile for %s lost, Redis unreachable: %s", reservation.tenant, exc)

    async def healthy(self) -> bool:
        """Redis answers PING; False at once while its breaker is open (a skipped PING), so /readyz polls
        cost no timeouts."""
        try:
            return bool(await self._redis.ping())
        except UNREACHABLE:
            return False

    async def aclose(self) -> None:
        await self._redis.aclose()

    def _failed(self, what: str, exc: BaseException) -> None:
        self.redis_errors += 1
        # While the breaker is open every request lands here: the breaker logs the opening and the
        # closing, and a line per skipped request would flood the log.
        log = logger.debug if isinstance(exc, RedisSkipped) else logger.warning
        log("rate limiter: %s failed, Redis unreachable (failing %s): %s", what, self.on_error, exc)
        if self.on_error == "closed":
            raise RateLimiterUnavailable(f"rate limiter store unreachable: {exc}") from exc
