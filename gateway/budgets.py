"""Token budgets per tenant and calendar window: `budgets: {tokens_per_day, tokens_per_month}` in the policy.

A request holds its token estimate (the same one the tokens-per-minute limit reserves) against every window
its tenant has a budget for, all or nothing: when the tenant's used tokens plus the estimate would pass a
budget, it is refused (429 `budget_exhausted`, Retry-After at the end of that window) and nothing is held.
When the request ends the hold is settled against the real usage, so what a tenant is charged is what it
used. Windows are UTC calendar days and months; a window's counter expires a while after it ends.

`RedisBudgets` keeps the counters in Redis (one Lua script checks and holds every window at once, so
replicas refuse exactly past the limit together); `MemoryBudgets` in this process. Used at 80% and 100% of
a budget is logged and counted, once per tenant, window and level on each replica.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

from gateway.policy import Budgets
from gateway.redis_client import redis_client

logger = logging.getLogger(__name__)

ALERT_LEVELS = (0.8, 1.0)
_KEEP_S = 3 * 24 * 3600  # a counter outlives its window by this much (settles of long requests land)


@dataclass(frozen=True, slots=True)
class Window:
    name: str  # "day" or "month"
    key: str  # e.g. "day:2026-12-01"
    ends_at: float  # wall-clock seconds
    limit: int


def windows(budgets: Budgets, now: float) -> list[Window]:
    """The windows `budgets` bounds at `now`."""
    t = datetime.fromtimestamp(now, timezone.utc)
    day = datetime(t.year, t.month, t.day, tzinfo=timezone.utc)
    month = datetime(t.year, t.month, 1, tzinfo=timezone.utc)
    next_month = datetime(t.year + t.month // 12, t.month % 12 + 1, 1, tzinfo=timezone.utc)
    found = []
    if budgets.tokens_per_day is not None:
        end = day.timestamp() + 24 * 3600
        found.append(Window("day", f"day:{day:%Y-%m-%d}", end, budgets.tokens_per_day))
    if budgets.tokens_per_month is not None:
        found.append(Window("month", f"month:{month:%Y-%m}", next_month.timestamp(), budgets.tokens_per_month))
    return found


@dataclass(frozen=True, slots=True)
class Hold:
    """Tokens held against a tenant's windows until the request is settled."""

    tenant: str
    tokens: int
    windows: tuple[Window, ...]


@dataclass(frozen=True, slots=True)
class Refusal:
    window: Window
    used: int

    @property
    def message(self) -> str:
        return f"over its tokens per {self.window.name} budget ({self.used} of {self.window.limit} used)"


class BudgetStore(ABC):
    """Holds and settles; `alerts` is called once per (tenant, window, level) reached on this replica."""

    def __init__(self, on_alert: Callable[[str, str, float], None] | None = None) -> None:
        self.on_alert = on_alert
        self._alerted: set[tuple[str, str, float]] = set()

    async def hold(self, tenant: str, budgets: Budgets, tokens: int, now: float) -> Hold | Refusal | None:
        """A hold of `tokens` on every window, or the refusal of the first window it would pass; None when
        the tenant has no budget."""
        found = windows(budgets, now)
        if not found:
            return None
        refused, used = await self._hold(tenant, found, tokens)
        if refused is not None:
            self._alert(tenant, found[refused], 1.0)
            return Refusal(found[refused], used[refused])
        for window, after in zip(found, used, strict=True):
            for level in ALERT_LEVELS:
                if after >= level * window.limit:
                    self._alert(tenant, window, level)
        return Hold(tenant, tokens, tuple(found))

    async def settle(self, hold: Hold, used_tokens: int) -> None:
        """The request used `used_tokens` (prompt + completion): give back or charge the difference."""
        if used_tokens != hold.tokens:
            await self._add(hold.tenant, hold.windows, used_tokens - hold.tokens)

    def _alert(self, tenant: str, window: Window, level: float) -> None:
        mark = (tenant, window.key, level)
        if mark in self._alerted:
            return
        self._alerted.add(mark)
        logger.warning(
            "tenant %r reached %d%% of its tokens per %s budget (%d)",
            tenant,
            round(level * 100),
            window.name,
            window.limit,
        )
        if self.on_alert is not None:
            self.on_alert(tenant, window.name, level)

    @abstractmethod
    async def _hold(self, tenant: str, found: list[Window], tokens: int) -> tuple[int | None, list[int]]:
        """Hold `tokens` on every window unless one would pass its limit: (None, used after, per window),
        or (index of the first that would pass, used now, per window) holding nothing."""

    @abstractmethod
    async def _add(self, tenant: str, found: tuple[Window, ...], delta: int) -> None: ...

    @abstractmethod
    async def used(self, tenant: str, budgets: Budgets, now: float) -> dict[str, int]:
        """Tokens used in each current window, by window name."""

    async def aclose(self) -> None:
        return None


class MemoryBudgets(BudgetStore):
    def __init__(self, on_alert: Callable[[str, str, float], None] | None = None) -> None:
        super().__init__(on_alert)
        self._used: dict[tuple[str, str], int] = {}

    async def _hold(self, tenant: str, found: list[Window], tokens: int) -> tuple[int | None, list[int]]:
        used = [self._used.get((tenant, w.key), 0) for w in found]
        for i, (window, now_used) in enumerate(zip(found, used, strict=True)):
            if now_used + tokens > window.limit:
                return i, used
        for window in found:
            self._used[(tenant, window.key)] = self._used.get((tenant, window.key), 0) + tokens
        return None, [u + tokens for u in used]

    async def _add(self, tenant: str, found: tuple[Window, ...], delta: int) -> None:
        for window in found:
            self._used[(tenant, window.key)] = max(0, self._used.get((tenant, window.key), 0) + delta)

    async def used(self, tenant: str, budgets: Budgets, now: float) -> dict[str, int]:
        return {w.name: self._used.get((tenant, w.key), 0) for w in windows(budgets, now)}


class RedisBudgets(BudgetStore):
    PREFIX = "loragate:budget:"

    # KEYS: one counter per window. ARGV: tokens, keep_s, then each window's limit and expiry (unix seconds).
    # Returns {refused index (0-based) or -1, used per window (after the hold when held)}.
    _HOLD = """
local need = tonumber(ARGV[1])
local used = {}
for i, key in ipairs(KEYS) do
  used[i] = tonumber(redis.call('GET', key) or '0')
end
for i, key in ipairs(KEYS) do
  if used[i] + need > tonumber(ARGV[1 + 2 * i]) then return {i - 1, unpack(used)} end
end
for i, key in ipairs(KEYS) do
  used[i] = redis.call('INCRBY', key, need)
  redis.call('EXPIREAT', key, tonumber(ARGV[2 + 2 * i]))
end
return {-1, unpack(used)}
"""

    # KEYS: the counters. ARGV: delta. Never below zero.
    _ADD = """
for _, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then
    local v = redis.call('INCRBY', key, tonumber(ARGV[1]))
    if v < 0 then redis.call('SET', key, 0, 'KEEPTTL') end
  end
end
return 0
"""

    def __init__(self, url: str, on_alert: Callable[[str, str, float], None] | None = None) -> None:
        super().__init__(on_alert)
        self._redis = redis_client(url)
        self._hold_script = self._redis.register_script(self._HOLD)
        self._add_script = self._redis.register_script(self._ADD)

    def _key(self, tenant: str, window: Window) -> str:
        return f"{self.PREFIX}{tenant}:{window.key}"

    async def _hold(self, tenant: str, found: list[Window], tokens: int) -> tuple[int | None, list[int]]:
        args: list[int | float | str] = [tokens, _KEEP_S]
        for window in found:
            args += [window.limit, int(window.ends_at) + _KEEP_S]
        reply = await self._hold_script(keys=[self._key(tenant, w) for w in found], args=args)
        refused, used = int(reply[0]), [int(u) for u in reply[1:]]
        return (None if refused < 0 else refused), used

    async def _add(self, tenant: str, found: tuple[Window, ...], delta: int) -> None:
        await self._add_script(keys=[self._key(tenant, w) for w in found], args=[delta])

    async def used(self, tenant: str, budgets: Budgets, now: float) -> dict[str, int]:
        found = windows(budgets, now)
        if not found:
            return {}
        values = await self._redis.mget([self._key(tenant, w) for w in found])
        return {w.name: int(v or 0) for w, v in zip(found, values, strict=True)}

    async def aclose(self) -> None:
        await self._redis.aclose()
