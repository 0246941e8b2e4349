"""Who is calling and whether they may, now: `TenantGate`.

  API key -> tenant (401 without a valid one; gateway/auth.py) -> not suspended by an operator (403;
  gateway/overrides.py) -> within the tenant's rate limits (429 rate_limited | tokens_exhausted; 503
  ratelimit_unavailable when Redis is down and the policy fails closed; gateway/ratelimit.py)

Every answer to a known tenant carries RateLimit-Limit / -Remaining / -Reset: from this request's decision,
or, for answers given before the limiter is asked (a 400, a 404), from the tenant's last one.
"""

from __future__ import annotations

import math
import time

from starlette.requests import Request

from gateway.clock import iso_time
from gateway.overrides import Overrides
from gateway.policy import Tenant
from gateway.ratelimit import Decision, RateLimiter, RateLimiterUnavailable, Reservation
from gateway.reload import ActivePolicy
from gateway.telemetry import GatewayMetrics
from loragate.errors import ApiError, retry_after, unauthorized, unavailable


def ratelimit_headers(decision: Decision) -> dict[str, str]:
    return {
        "RateLimit-Limit": str(decision.limit),
        "RateLimit-Remaining": str(max(0, decision.remaining)),
        "RateLimit-Reset": str(math.ceil(max(0.0, decision.reset_s))),
    }


class TenantGate:
    """Authentication, suspensions and rate limits, for the generation routes and GET /v1/models."""

    def __init__(self, limiter: RateLimiter, overrides: Overrides, metrics: GatewayMetrics) -> None:
        self.limiter = limiter
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
    ) -> tuple[dict[str, str], Reservation | None]:
        """The RateLimit-* headers and the reservation; 429 over a limit, 503 when Redis fails closed."""
        try:
            decision, reservation = await self.limiter.acquire(tenant.id, active.policy.limits_for(tenant), tokens)
        except RateLimiterUnavailable:
            self.metrics.count_ratelimit("unavailable")
            raise unavailable("the rate limiter's store is unreachable", "ratelimit_unavailable") from None
        self._decisions[tenant.id] = (decision, time.monotonic())
        headers = ratelimit_headers(decision)
        self.metrics.count_ratelimit("allowed" if decision.allowed else (decision.reason or "rate_limited"))
        if not decision.allowed:
            reason = decision.reason or "rate_limited"
            what = "requests" if reason == "rate_limited" else "tokens per minute"
            raise ApiError(
                429,
                "rate_limit_exceeded",
                f"tenant {tenant.id!r} is over its {what} limit",
                {**headers, "Retry-After": retry_after(decision.retry_after_s), "X-Loragate-Reason": reason},
            )
        return headers, reservation
