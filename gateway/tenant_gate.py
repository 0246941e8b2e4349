"""Who is calling and whether they may, now: `TenantGate`.

  API key -> tenant (401 without a valid one; gateway/auth.py) -> not suspended by an operator (403;
  gateway/overrides.py) -> within the tenant's rate limits (429 rate_limited | tokens_exhausted; 503
  ratelimit_unavailable when Redis is down and the policy fails closed; gateway/ratelimit.py) -> within its
  token budgets for the day and the month (429 budget_exhausted, Retry-After at the window's end;
  gateway/budgets.py)

Every answer to a known tenant carries RateLimit-Limit / -Remaining / -Reset: from this request's decision,
or, for answers given before the limiter is asked (a 400, a 404), from the tenant's last one.
"""

from __future__ import annotations

import logging
import math
import time

from starlette.requests import Request

from gateway.budgets import BudgetStore, Hold, Refusal
from gateway.clock import iso_time
from gateway.overrides import Overrides
from gateway.policy import Tenant
from gateway.ratelimit import Decision, RateLimiter, RateLimiterUnavailable, Reservation
from gateway.redis_client import UNREACHABLE, RedisSkipped
from gateway.reload import ActivePolicy
from gateway.telemetry import GatewayMetrics
from loragate_common.errors import ApiError, retry_after, unauthorized, unavailable

logger = logging.getLogger(__name__)


def ratelimit_headers(decision: Decision) -> dict[str, str]:
    return {
        "RateLimit-Limit": str(decision.limit),
        "RateLimit-Remaining": str(max(0, decision.remaining)),
        "RateLimit-Reset": str(math.ceil(max(0.0, decision.reset_s))),
    }


class TenantGate:
    """Authentication, suspensions and rate limits, for the generation routes and GET /v1/models."""

    def __init__(
        self, limiter: RateLimiter, overrides: Overrides, metrics: GatewayMetrics, budgets: BudgetStore
    ) -> None:
        self.limiter = limiter
        self.budgets = budgets
        self.overrides = overrides
        self.metrics = metrics
        self._decisions: dict[str, tuple[Decision, float]] = {}  # tenant -> last decision, at (monotonic)

    def tenant(self, request: Request, active: ActivePolicy) -> Tenant:
        """The caller's tenant: 401 without a valid key, 403 while an operator has it suspended."""
        tenant = self.authenticate(request, active)
        self.refuse_suspended(tenant)
        return tenant

    def authenticate(self, request: Request, active: ActivePolicy) -> Tenant:
        tenant = active.auth.tenant_for(request.headers.get("authorization"))
        if tenant is None:
            raise unauthorized("a valid API key is required (Authorization: Bearer <key>)")
        return tenant

    def refuse_suspended(self, tenant: Tenant) -> None:
        suspended = self.overrides.suspended(tenant.id)
        if suspended is not None:
            raise ApiError(
                403,
                "tenant_suspended",
                f"tenant {tenant.id!r} is suspended: {suspended.reason} "
                f"(since {iso_time(suspended.at)}); ask the platform team to resume it",
            )

    def known_headers(self, tenant: str) -> dict[str, str]:
        """RateLimit-* from the tenant's last decision, for answers given before the limiter is asked."""
        last = self._decisions.get(tenant)
        if last is None:
            return {}
        decision, at = last
        elapsed = time.monotonic() - at
        return ratelimit_headers(
            Decision(
                decision.allowed,
                decision.reason,
                0.0,
                decision.limit,
                decision.remaining,
                max(0.0, decision.reset_s - elapsed),
            )
        )

    async def rate_limit(
        self, tenant: Tenant, tokens: int, active: ActivePolicy
    ) -> tuple[dict[str, str], Reservation | None, Hold | None]:
        """The RateLimit-* headers, the reservation and the budget hold; 429 over a limit or a budget, 503
        when Redis is unreachable and the policy fails closed. Nothing is held when the answer is no."""
        hold = await self._hold_budget(tenant, tokens, active)
        try:
            decision, reservation = await self.limiter.acquire(tenant.id, active.policy.limits_for(tenant), tokens)
        except RateLimiterUnavailable:
            await self.settle_budget(hold, 0)
            self.metrics.count_ratelimit("unavailable")
            raise unavailable("the rate limiter's store is unreachable", "ratelimit_unavailable") from None
        self._decisions[tenant.id] = (decision, time.monotonic())
        headers = ratelimit_headers(decision)
        self.metrics.count_ratelimit("allowed" if decision.allowed else (decision.reason or "rate_limited"))
        if not decision.allowed:
            await self.settle_budget(hold, 0)
            reason = decision.reason or "rate_limited"
            what = "requests" if reason == "rate_limited" else "tokens per minute"
            raise ApiError(
                429,
                "rate_limit_exceeded",
                f"tenant {tenant.id!r} is over its {what} limit",
                {**headers, "Retry-After": retry_after(decision.retry_after_s), "X-Loragate-Reason": reason},
            )
        return headers, reservation, hold

    async def _hold_budget(self, tenant: Tenant, tokens: int, active: ActivePolicy) -> Hold | None:
        try:
            held = await self.budgets.hold(tenant.id, tenant.budgets, tokens, time.time())
        except UNREACHABLE as exc:
            if active.policy.ratelimit.on_redis_error == "closed":
                self.metrics.count_ratelimit("unavailable")
                raise unavailable("the budget store is unreachable", "ratelimit_unavailable") from None
            # Once per outage (the breaker opening logs it), not once per request while it is open.
            log = logger.debug if isinstance(exc, RedisSkipped) else logger.warning
            log("budgets unchecked for tenant %r: the store is unreachable (%s)", tenant.id, exc)
            return None
        if isinstance(held, Refusal):
            self.metrics.count_ratelimit("budget_exhausted")
            headers = {**self.known_headers(tenant.id), "X-Loragate-Reason": "budget_exhausted"}
            headers["Retry-After"] = retry_after(held.window.ends_at - time.time())
            raise ApiError(429, "budget_exhausted", f"tenant {tenant.id!r} is {held.message}", headers)
        return held

    async def settle_budget(self, hold: Hold | None, used_tokens: int) -> None:
        """Charge a held request what it used (0: it never ran); a store that is down forgives the rest."""
        if hold is None:
            return
        try:
            await self.budgets.settle(hold, used_tokens)
        except UNREACHABLE as exc:
            logger.warning("settling %s's budget hold failed: %s", hold.tenant, exc)
