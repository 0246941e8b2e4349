"""The gateway's HTTP app (Starlette): one generation request's path through the gateway.

  auth (Bearer key -> tenant, else 401) -> body (413 / 400) -> adapter (X-Adapter-ID or `model`; a rollout
  name -> one of its variants, gateway/rollout.py; not allowed -> 403; unknown -> 404) -> priority
  (X-Priority capped to the tenant's max_priority) -> rate limit (429 rate_limited | tokens_exhausted) ->
  admission (an upstream by adapter affinity; 503 queue_full | queue_timeout | circuit_open | no_upstream |
  draining) -> proxy (gateway/proxy.py) -> settle: release the slot, reconcile the token reservation with
  the real usage, record the rollout variant's outcome, metrics, span.

A request reads `store.active` once, when it starts, and finishes under that policy whatever reloads
meanwhile. The generation routes are plain ASGI callables (not request -> response functions) so that
one task owns the request from the first byte read to the last byte sent: the span stays current while
the stream runs, and the settle step runs after the response is done, however it ended.

A background loop (the app's lifespan) polls the policy file for changes, exchanges rollbacks, rollout
steps and operator overrides (suspended tenants, drained upstreams: gateway/overrides.py) with the other
replicas through Redis and moves progressive rollouts on, about once a second; with `--upstream-dns`,
another re-resolves the engines' DNS name every few seconds (gateway/discovery.py) and updates the
upstreams.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import anyio
import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway.admin import AdminRoutes, unauthorized
from gateway.admission import AdmissionController, Shed, Upstream
from gateway.breaker import CircuitBreaker
from gateway.clock import iso_time
from gateway.discovery import DnsUpstreams
from gateway.overrides import Overrides
from gateway.policy import Policy, PolicyError, Tenant
from gateway.proxy import Call, Exchange, Proxy
from gateway.ratelimit import Decision, RateLimiter, RateLimiterUnavailable, Reservation
from gateway.reload import ActivePolicy, PolicyStore
from gateway.request_context import GenerationBody, HeaderLimit, resolve_priority, upstream_body
from gateway.rollout import LocalShare, RollbackShare, Routed
from gateway.routes import HANDLERS, Api
from gateway.telemetry import GatewayMetrics, finish_span, request_span
from gateway.upstream import DEFAULT_READ_TIMEOUT_S, UpstreamCatalog, make_client
from gateway.watch import PolicyWatcher
from loragate.errors import ApiError, adapter_not_found, bad_request, error_response, shown
from loragate.http_io import ClientGone, read_json, unless_disconnected

logger = logging.getLogger(__name__)


BACKGROUND_INTERVAL_S = 1.0  # policy file polls and rollback exchanges

# The X-Loragate-Reason values; the metrics' reason label takes only these.
REASONS = frozenset(
    {
        "rate_limited",
        "tokens_exhausted",
        "queue_full",
        "queue_timeout",
        "circuit_open",
        "no_upstream",
        "draining",
        "ratelimit_unavailable",
        "upstream_unavailable",
    }
)


def _seconds(value: float) -> str:
    return str(max(1, math.ceil(value)))


def shed_response(shed: Shed, headers: dict[str, str]) -> JSONResponse:
    return error_response(
        503,
        "service_unavailable",
        shed.message,
        {**headers, "X-Loragate-Reason": shed.reason, "Retry-After": _seconds(shed.retry_after_s)},
    )


def ratelimit_headers(decision: Decision) -> dict[str, str]:
    return {
        "RateLimit-Limit": str(decision.limit),
        "RateLimit-Remaining": str(max(0, decision.remaining)),
        "RateLimit-Reset": str(math.ceil(max(0.0, decision.reset_s))),
    }


class Gateway:
    """The state one app serves from: policy, limiter, admission, upstreams, proxy, metrics."""

    def __init__(
        self,
        store: PolicyStore,
        limiter: RateLimiter,
        admission: AdmissionController,
        catalog: UpstreamCatalog,
        proxy: Proxy,
        metrics: GatewayMetrics,
        max_body_bytes: int,
        discovery: DnsUpstreams | None = None,
        share: RollbackShare | None = None,
    ) -> None:
        self.store = store
        self.share = share if share is not None else LocalShare()  # what the replicas share (Redis)
        self.overrides = Overrides(self.share)
        self.discovery = discovery
        self.static_urls = [u.url for u in admission.upstreams]
        self.limiter = limiter
        self.admission = admission
        self.catalog = catalog
        self.proxy = proxy
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.draining = False
        self._decisions: dict[str, tuple[Decision, float]] = {}  # tenant -> last decision, for headers
        self.watcher = PolicyWatcher(store.path) if store.path is not None else None
        self._sync_failing = False

    def set_upstreams(self, urls: list[str]) -> None:
        """Serve from exactly these engine URLs (the static ones plus those discovered in DNS): new ones
        join with a fresh breaker, vanished ones get no new request and their requests in flight finish."""
        current = {u.url: u for u in self.admission.upstreams}
        if set(urls) == set(current):
            return
        b = self.store.active.policy.breaker
        upstreams = [
            current.get(url) or Upstream(url, CircuitBreaker(b.failure_threshold, b.open_seconds, b.half_open_probes))
            for url in urls
        ]
        joined, left = sorted(set(urls) - set(current)), sorted(set(current) - set(urls))
        logger.info(
            "upstreams: %d (joined %s; left %s)", len(urls), ", ".join(joined) or "none", ", ".join(left) or "none"
        )
        self.admission.set_upstreams(upstreams)
        self.apply_overrides()
        self.catalog.invalidate()

    async def discover(self) -> None:
        """Resolve the engines' DNS name once and serve from what it says (with the static upstreams)."""
        if self.discovery is None:
            return
        found = await self.discovery.urls()
        if found is not None:
            self.set_upstreams(sorted(set(self.static_urls) | set(found)))

    async def discovering(self) -> None:
        """Until cancelled: `discover()` every `discovery.interval_s`."""
        assert self.discovery is not None
        while True:
            await asyncio.sleep(self.discovery.interval_s)
            try:
                await self.discover()
            except Exception:
                logger.exception("engine discovery failed")

    def apply_settings(self, policy: Policy) -> None:
        """A reloaded policy's admission, breaker and rate-limiter settings, applied in place."""
        a, b = policy.admission, policy.breaker
        self.admission.reconfigure(a.max_inflight_per_upstream, a.max_queue, a.queue_timeout_s, a.spill_at)
        for upstream in self.admission.upstreams:
            upstream.breaker.reconfigure(b.failure_threshold, b.open_seconds, b.half_open_probes)
        self.limiter.on_error = policy.ratelimit.on_redis_error

    def apply_overrides(self) -> None:
        """Drain exactly the upstreams the operators' overrides name."""
        self.admission.set_drained(self.overrides.drained())

    async def clear_overrides(self) -> None:
        """Lift every override (POST /admin/reload, POST /admin/overrides/clear, --clear-overrides)."""
        try:
            await self.overrides.clear()
        except Exception as exc:  # Redis down: lifted here; the shared ones stay until it is back
            logger.warning("could not clear the shared overrides: %s", exc)
        self.apply_overrides()

    @staticmethod
    def upstream_state(upstream: Upstream) -> dict[str, Any]:
        return {
            "url": upstream.url,
            "inflight": upstream.inflight,
            "breaker": upstream.breaker.state,
            "consecutive_failures": upstream.breaker.consecutive_failures,
            "drained": upstream.drained,
        }

    def routing(self) -> dict[str, Any]:
        """For GET /admin/policy: each upstream's load, breaker and drain, each known adapter's preferred
        upstream."""
        upstreams = [self.upstream_state(u) for u in self.admission.upstreams]
        affinity = {}
        if self.store.active.policy.admission.affinity:
            affinity = {a: self.admission.preferred(a) for a in sorted(self.catalog.cached().adapters)}
        return {
            "upstreams": upstreams,
            "affinity": affinity,
            "spill_inflight": self.admission.spill_inflight,
            "spills": self.admission.spills,
        }

    async def served_adapters(self) -> frozenset[str]:
        """The adapter ids the upstreams serve (empty when none has answered yet)."""
        return (await self.catalog.models()).adapters

    async def background(self, interval_s: float) -> None:
        """Until cancelled: reload a changed policy file, exchange rollbacks with the other replicas."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.housekeeping()
            except Exception:
                logger.exception("gateway housekeeping failed")

    async def housekeeping(self) -> None:
        """One round of the background loop (tests call it directly)."""
        # A new digest that is already active: POST /admin/reload loaded these bytes first.
        if self.watcher is not None and self.watcher.check() and self.watcher.digest != self.store.active.sha256:
            with contextlib.suppress(PolicyError):  # logged, counted and shown by the store
                self.store.reload(await self.served_adapters(), fresh=False)
        try:
            await self.store.active.rollouts.sync()
            for url in await self.overrides.sync():  # a breaker reset sent to another replica
                for upstream in self.admission.upstreams:
                    if upstream.url == url and upstream.breaker.reset():
                        logger.info("breaker of %s reset by an operator (through another replica)", url)
        except Exception as exc:
            if not self._sync_failing:
                logger.warning("sharing rollouts and overrides failed (kept locally until it works): %s", exc)
            self._sync_failing = True
        else:
            self._sync_failing = False
        self.apply_overrides()

    def drain(self) -> None:
        """Stop admitting (503 draining, /readyz 503); requests in flight finish."""
        self.draining = True
        self.admission.drain()

    def base_name(self, named: str | None) -> str:
        """The base model a request without an adapter is served by (the one it named, if several)."""
        bases = self.catalog.cached().bases
        if named in bases:
            return named
        return min(bases) if bases else "base"

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

    async def resolve_adapter(
        self, request: Request, body: GenerationBody, tenant: Tenant, active: ActivePolicy
    ) -> tuple[str | None, Routed | None]:
        """The adapter to serve (None: the base model), and the rollout routing that chose it, if any.

        403 not allowed, 404 unknown; a rollout's override header may answer 400 or 403 (rollout.py)."""
        named = request.headers.getlist("x-adapter-id")
        if len(named) > 1:
            raise bad_request("X-Adapter-ID: given more than once; name one adapter")
        name = (named[0] if named else "").strip() or (body.model or "").strip()
        models = await self.catalog.models()
        if not name or name in models.bases:
            return None, None
        if not tenant.allows(name):
            raise ApiError(403, "permission_denied", f"adapter {shown(name)} is not allowed for tenant {tenant.id!r}")
        routed = None
        if active.policy.rollout(name) is not None:
            routed = active.rollouts.route(name, tenant, request.headers.get)
        adapter = routed.adapter if routed is not None else name
        if models.all and adapter not in models.adapters:  # nothing learned yet: the upstream decides
            if routed is not None:  # a variant nobody serves is the rollout's failure, not the client's
                self.observe_variant(active, routed.rollout, adapter, error=True, ttft_s=None)
            raise adapter_not_found(adapter)
        return adapter, routed

    def observe_variant(
        self, active: ActivePolicy, rollout: str, adapter: str, error: bool, ttft_s: float | None
    ) -> None:
        """One finished request of a rollout variant: its metrics and its rollback window."""
        self.metrics.observe_variant(rollout, adapter, error, ttft_s)
        active.rollouts.record(rollout, adapter, error, ttft_s)

    async def rate_limit(
        self, tenant: Tenant, tokens: int, active: ActivePolicy
    ) -> tuple[dict[str, str], Reservation | None]:
        """The RateLimit-* headers and the reservation; 429 over a limit, 503 when Redis fails closed."""
        try:
            decision, reservation = await self.limiter.acquire(tenant.id, active.policy.limits_for(tenant), tokens)
        except RateLimiterUnavailable:
            self.metrics.count_ratelimit("unavailable")
            raise ApiError(
                503,
                "service_unavailable",
                "the rate limiter's store is unreachable",
                {"Retry-After": "1", "X-Loragate-Reason": "ratelimit_unavailable"},
            ) from None
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
                {**headers, "Retry-After": _seconds(decision.retry_after_s), "X-Loragate-Reason": reason},
            )
        return headers, reservation

    async def settle(self, exchange: Exchange) -> None:
        """After the response: close the upstream, free the slot, give back unused reserved tokens."""
        with anyio.CancelScope(shield=True):
            await exchange.close_upstream()
            if exchange.slot is not None:
                exchange.slot.release()
            reservation, exchange.reservation = exchange.reservation, None  # settle it once
            if reservation is None:
                return
            if exchange.prompt_tokens is not None and exchange.completion_tokens is not None:
                used = exchange.prompt_tokens + exchange.completion_tokens
            else:  # no usage seen: nothing was generated, or we cannot tell (then keep the reservation)
                used = reservation.tokens if exchange.delivered else 0
            try:
                await self.limiter.reconcile(reservation, used)
            except Exception:
                logger.exception("reconciling %s's token reservation failed", reservation.tenant)


class Generate:
    """POST /v1/completions or /v1/chat/completions, as an ASGI app."""

    def __init__(self, gateway: Gateway, path: str, chat: bool) -> None:
        self.gw = gateway
        self.path = path
        self.chat = chat
        self.operation = "chat" if chat else "text_completion"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        started = time.monotonic()
        tenant_id = "unknown"
        active = self.gw.store.active  # this request's policy, to the end
        try:
            tenant = self.gw.authenticate(request, active)
            tenant_id = tenant.id  # from here on, answers count as this tenant's
            self.gw.refuse_suspended(tenant)
            data = await read_json(request, self.gw.max_body_bytes)
            body = GenerationBody.parse(data, self.chat)
            adapter, routed = await self.gw.resolve_adapter(request, body, tenant, active)
            priority = resolve_priority(request.headers.get("x-priority"), active.policy, tenant)
        except ApiError as exc:
            headers = {**self.gw.known_headers(tenant_id), **exc.headers}
            await error_response(exc.status, exc.type, exc.message, headers)(scope, receive, send)
            self.gw.metrics.observe_request(
                tenant_id, "", exc.status, exc.headers.get("X-Loragate-Reason"), time.monotonic() - started
            )
            return
        shown = adapter or self.gw.base_name(body.model)
        call = Call(
            self.path,
            upstream_body(data, adapter),
            tenant.id,
            adapter,
            shown,
            priority,
            body.stream,
            body.include_usage,
            started,
            routed.rollout if routed is not None else None,
            adapter if active.policy.admission.affinity else None,
        )
        with request_span(
            self.operation, shown, tenant=tenant.id, adapter=shown, priority=priority.name.lower()
        ) as span:
            if routed is not None:
                span.set_attribute("loragate.rollout", routed.rollout)
                span.set_attribute("loragate.rollout.route", routed.how)  # split, override or rollback
            exchange = Exchange()
            try:
                try:
                    response = await self._admit_and_forward(request, tenant, body, call, exchange, active)
                except ApiError as exc:
                    exchange.status = exc.status
                    exchange.outcome = exc.headers.get("X-Loragate-Reason", exc.type)
                    response = error_response(exc.status, exc.type, exc.message, exc.headers)
                if not isinstance(response, StreamingResponse):
                    # The outcome is known: judge the variant before the client can send its next request.
                    self._judge_variant(active, call, exchange)
                await response(scope, receive, send)
            finally:
                await self.gw.settle(exchange)
                exchange.status = exchange.status or 500  # 0: an unexpected error, answered 500 by Starlette
                finish_span(
                    span,
                    status_code=exchange.status,
                    outcome=exchange.outcome,
                    input_tokens=exchange.prompt_tokens,
                    output_tokens=exchange.completion_tokens,
                )
                reason = exchange.outcome if exchange.outcome in REASONS else None
                self.gw.metrics.observe_request(tenant.id, shown, exchange.status, reason, time.monotonic() - started)
                self._judge_variant(active, call, exchange)  # a stream: now that it has ended

    def _judge_variant(self, active: ActivePolicy, call: Call, exchange: Exchange) -> None:
        """Record a rollout request's outcome against its variant, once, if it reached an upstream (and
        the client did not leave first)."""
        if call.rollout is None or exchange.judged or not exchange.tried or exchange.status == 499:
            return
        exchange.judged = True
        # An engine's 503 (overloaded, draining) says "not now", nothing about the variant.
        error = exchange.status >= 500 and exchange.status != 503 or exchange.outcome == "upstream_error"
        self.gw.observe_variant(active, call.rollout, call.served, error, exchange.ttft_s)

    async def _admit_and_forward(
        self,
        request: Request,
        tenant: Tenant,
        body: GenerationBody,
        call: Call,
        exchange: Exchange,
        active: ActivePolicy,
    ) -> Response:
        if self.gw.draining:
            raise ApiError(
                503,
                "service_unavailable",
                "the gateway is draining and takes no new requests",
                {"Retry-After": "1", "X-Loragate-Reason": "draining"},
            )
        headers, exchange.reservation = await self.gw.rate_limit(tenant, body.reserve_tokens, active)
        try:
            exchange.slot = await unless_disconnected(
                request.receive, self.gw.admission.acquire(call.priority, call.tenant, affinity=call.affinity)
            )
            response = await unless_disconnected(request.receive, self.gw.proxy.forward(call, exchange))
        except Shed as shed:
            exchange.status, exchange.outcome = 503, shed.reason
            return shed_response(shed, headers)
        except ClientGone:
            exchange.status, exchange.outcome = 499, "client_gone"
            return Response(status_code=499)  # nobody reads it; uvicorn drops it
        if exchange.status == 0:
            exchange.status = response.status_code
        response.headers.update(headers)
        if response.status_code < 400 or exchange.tried:  # an engine's error names the adapter that failed
            response.headers["X-Loragate-Adapter"] = call.served
        return response


def build_app(
    policy: Policy,
    upstream_urls: list[str],
    limiter: RateLimiter,
    *,
    metrics: GatewayMetrics | None = None,
    max_body_bytes: int = 1 << 20,
    client: httpx.AsyncClient | None = None,
    policy_path: Path | None = None,
    environ: Mapping[str, str] = os.environ,
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
    rollback_share: RollbackShare | None = None,
    background_interval_s: float = BACKGROUND_INTERVAL_S,
    discovery: DnsUpstreams | None = None,
    clear_overrides: bool = False,
) -> Starlette:
    """The gateway app in front of `upstream_urls` (and of the engines `discovery` finds in DNS).

    `policy_path` enables hot reload (POST /admin/reload, and the file watched while the app's lifespan
    runs); `rollback_share` (gateway.rollout.RedisShare) shares rollbacks, rollout steps and operator
    overrides with other replicas; `clear_overrides` lifts the overrides at start (--clear-overrides).
    """
    metrics = metrics if metrics is not None else GatewayMetrics()
    b = policy.breaker
    upstreams = [
        Upstream(url.rstrip("/"), CircuitBreaker(b.failure_threshold, b.open_seconds, b.half_open_probes))
        for url in upstream_urls
    ]
    a = policy.admission
    admission = AdmissionController(
        upstreams, a.max_inflight_per_upstream, a.max_queue, a.queue_timeout_s, spill_inflight=a.spill_at
    )
    own_client = client is None
    http = client if client is not None else make_client(a.max_inflight_per_upstream, len(upstreams), read_timeout_s)
    share = rollback_share if rollback_share is not None else LocalShare()
    store = PolicyStore(
        policy,
        policy_path,
        environ,
        share,
        on_rollback=lambda name, rollback: metrics.count_rollback(name, rollback.reason),
        on_reload_error=metrics.count_reload_error,
        on_reload=lambda new: gateway.apply_settings(new),
        on_step=lambda name, control: metrics.count_rollout_step(name, control.status),
    )
    catalog = UpstreamCatalog(lambda: admission.upstreams, http)
    gateway = Gateway(
        store, limiter, admission, catalog, Proxy(http, admission, metrics), metrics, max_body_bytes, discovery, share
    )
    metrics.bind(
        queue_depths=admission.queue_depths,
        inflight=admission.inflight,
        breaker_states=lambda: {u.url: u.breaker.state for u in admission.upstreams},
        redis_errors=lambda: int(getattr(limiter, "redis_errors", 0)),
        rolled_back=lambda: {name: store.active.rollouts.is_rolled_back(name) for name in store.active.rollouts.states},
        spills=lambda: admission.spills,
        rollout_weights=lambda: store.active.rollouts.weights(),
        overrides=lambda: gateway.overrides.describe(),
    )
    api, admin = Api(gateway), AdminRoutes(gateway)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if clear_overrides:
            await gateway.clear_overrides()
        with contextlib.suppress(Exception):  # Redis down: the loop retries
            await gateway.housekeeping()  # the fleet's overrides and rollout steps before the first request
        tasks = [asyncio.create_task(gateway.background(background_interval_s))]
        if discovery is not None:
            await gateway.discover()  # serve from what DNS says from the first request on
            tasks.append(asyncio.create_task(gateway.discovering()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            gateway.drain()
            if own_client:
                await http.aclose()
            await limiter.aclose()
            await share.aclose()

    routes = [
        Route("/v1/completions", Generate(gateway, "/v1/completions", chat=False), methods=["POST"]),
        Route("/v1/chat/completions", Generate(gateway, "/v1/chat/completions", chat=True), methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/healthz", api.healthz, methods=["GET"]),
        Route("/readyz", api.readyz, methods=["GET"]),
        Route("/metrics", api.metrics_text, methods=["GET"]),
        Route("/admin/policy", admin.policy, methods=["GET"]),
        Route("/admin/reload", admin.reload, methods=["POST"]),
        Route("/admin/rollouts/{name}/{action}", admin.rollout, methods=["POST"]),
        Route("/admin/upstreams/{action}", admin.upstream, methods=["POST"]),
        Route("/admin/tenants/{id}/{action}", admin.tenant, methods=["POST"]),
        Route("/admin/overrides/clear", admin.clear_overrides, methods=["POST"]),
        Route("/admin/ui", admin.ui, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers=HANDLERS, lifespan=lifespan, middleware=[Middleware(HeaderLimit)])
    app.state.gateway = gateway
    return app
