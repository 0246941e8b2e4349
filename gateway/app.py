"""The gateway's HTTP app (Starlette): `build_app` builds the parts and wires them, nothing more.

  TenantGate (gateway/tenant_gate.py)     API key -> tenant, suspensions, rate limits
  Fleet (gateway/fleet.py)                the engines: upstreams, admission, what they serve, drains
  GenerateRoutes (gateway/generate.py)    POST /v1/completions, /v1/chat/completions: a request's path
  ApiRoutes (gateway/routes.py)           GET /v1/models, /healthz, /readyz, /metrics
  AdminRoutes (gateway/admin.py)          /admin/*: the policy, operator actions, the ops page
  AdapterRoutes (gateway/adapter_admin.py)  /admin/adapters: the fleet's adapter catalog
  AdapterCatalog (gateway/adapter_catalog.py)  catalog ids -> versions pinned to a source (Redis or memory)
  PolicyStore (gateway/reload.py)         the active policy, hot reload, the rollouts built from it
  FleetStore (gateway/fleet_store.py)     what the replicas share through Redis
  UsageLedger (gateway/usage.py)          one record per finished request, written in the background
  BudgetStore (gateway/budgets.py)        tokens per day and month per tenant

A background loop (the app's lifespan, `Gateway.housekeeping`) polls the policy file for changes, exchanges
rollbacks, rollout steps and operator overrides (suspended tenants, drained upstreams: gateway/overrides.py)
with the other replicas through Redis, moves progressive rollouts on and reads the adapter catalog again,
about once a second; with
`--upstream-dns`, another re-resolves the engines' DNS name every few seconds (gateway/discovery.py) and
updates the upstreams.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware

from gateway.adapter_admin import AdapterRoutes
from gateway.adapter_catalog import AdapterCatalog
from gateway.admin import AdminRoutes
from gateway.admission import AdmissionController, Upstream
from gateway.budgets import BudgetStore, MemoryBudgets
from gateway.catalog_store import CatalogStore, LocalCatalogStore
from gateway.discovery import DnsUpstreams
from gateway.engine_kinds import parse_upstream
from gateway.fleet import Fleet, new_breaker
from gateway.fleet_store import FleetStore, LocalFleetStore
from gateway.generate import GenerateRoutes
from gateway.overrides import Overrides
from gateway.policy import Policy, PolicyError
from gateway.prefix_index import PrefixIndex, RedisPrefixStore
from gateway.proxy import Proxy
from gateway.ratelimit import RateLimiter
from gateway.redis_client import breakers_of, stop_probes
from gateway.reload import PolicyStore
from gateway.request_context import HeaderLimit
from gateway.routes import ApiRoutes
from gateway.telemetry import GatewayMetrics
from gateway.tenant_gate import TenantGate
from gateway.upstream import DEFAULT_READ_TIMEOUT_S, UpstreamCatalog, make_client
from gateway.usage import MemoryUsageLedger, UsageLedger
from gateway.watch import PolicyWatcher
from loragate_common.errors import HANDLERS

logger = logging.getLogger(__name__)

BACKGROUND_INTERVAL_S = 1.0  # policy file polls, rollback exchanges, usage ledger writes
SHUTDOWN_FLUSH_S = 5.0  # at shutdown, the usage ledger's buffer gets this long to reach the store


@dataclass(eq=False)
class Gateway:
    """One app's parts (`app.state.gateway`), and the background round that keeps them current."""

    store: PolicyStore
    fleet: Fleet
    gate: TenantGate
    metrics: GatewayMetrics
    fleet_store: FleetStore
    ledger: UsageLedger
    adapters: AdapterCatalog
    watcher: PolicyWatcher | None = None
    _sync_failing: bool = False

    def apply_settings(self, policy: Policy) -> None:
        """A reloaded policy's admission, breaker and rate-limiter settings, applied in place."""
        self.fleet.apply_settings(policy)
        self.gate.limiter.on_error = policy.ratelimit.on_redis_error
        self.metrics.adapter_label.name_from_policy(
            (t.adapters for t in policy.tenants), ((r.name, (v.adapter for v in r.variants)) for r in policy.rollouts)
        )

    def drain(self) -> None:
        self.fleet.drain()

    async def background(self, interval_s: float) -> None:
        """Until cancelled: `housekeeping()` every `interval_s`."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.housekeeping()
            except Exception:
                logger.exception("gateway housekeeping failed")

    async def housekeeping(self) -> None:
        """One round: reload a changed policy file, exchange rollouts and overrides with the other replicas
        (tests call it directly)."""
        # A new digest that is already active: POST /admin/reload loaded these bytes first.
        if self.watcher is not None and self.watcher.check() and self.watcher.digest != self.store.active.sha256:
            with contextlib.suppress(PolicyError):  # logged, counted and shown by the store
                self.store.reload(self.adapters.served(await self.fleet.served_adapters()), fresh=False)
        try:
            await self.store.active.rollouts.sync()
            await self.fleet.sync_overrides()
        except Exception as exc:
            if not self._sync_failing:
                logger.warning("sharing rollouts and overrides failed (kept locally until it works): %s", exc)
            self._sync_failing = True
        else:
            self._sync_failing = False
        self.fleet.apply_overrides()
        await self.adapters.refresh()  # keeps the last snapshot while the store is unreachable
        await self.ledger.flush()


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
    fleet_store: FleetStore | None = None,
    ledger: UsageLedger | None = None,
    budgets: BudgetStore | None = None,
    background_interval_s: float = BACKGROUND_INTERVAL_S,
    discovery: DnsUpstreams | Sequence[DnsUpstreams] | None = None,
    clear_overrides: bool = False,
    catalog_store: CatalogStore | None = None,
    prefix_store: RedisPrefixStore | None = None,
) -> Starlette:
    """The gateway app in front of `upstream_urls` (`--upstream` values: gateway/engine_kinds.py) and of the
    engines `discovery` finds in DNS.

    `policy_path` enables hot reload (POST /admin/reload, and the file watched while the app's lifespan
    runs); `fleet_store` (gateway/fleet_store.py's RedisFleetStore) shares rollbacks, rollout steps and
    operator overrides with other replicas; `ledger` and `budgets` (gateway/usage.py, gateway/budgets.py)
    default to this process's memory; `clear_overrides` lifts the overrides at start (--clear-overrides);
    `catalog_store` (gateway/catalog_store.py's RedisCatalogStore) shares the adapter catalog, else it is
    this process's; `prefix_store` shares which engine holds which prompt prefix (gateway/prefix_index.py).
    """
    metrics = metrics if metrics is not None else GatewayMetrics()
    shared = fleet_store if fleet_store is not None else LocalFleetStore()
    targets = [parse_upstream(u) for u in upstream_urls]
    upstreams = [Upstream(t.url, new_breaker(policy.breaker), t.kind, t.agent) for t in targets]
    discoveries = [discovery] if isinstance(discovery, DnsUpstreams) else list(discovery or ())
    a = policy.admission
    admission = AdmissionController(
        upstreams, a.max_inflight_per_upstream, a.max_queue, a.queue_timeout_s, spill_inflight=a.spill_at
    )
    own_client = client is None
    http = client if client is not None else make_client(a.max_inflight_per_upstream, len(upstreams), read_timeout_s)
    store = PolicyStore(
        policy,
        policy_path,
        environ,
        shared,
        on_rollback=lambda name, rollback: metrics.count_rollback(name, rollback.reason),
        on_reload_error=metrics.count_reload_error,
        on_reload=lambda new: gateway.apply_settings(new),
        on_step=lambda name, control: metrics.count_rollout_step(name, control.status),
    )
    overrides = Overrides(shared)
    prefix = PrefixIndex(a.prefix, a.session_key, prefix_store)
    fleet = Fleet(store, admission, UpstreamCatalog(lambda: admission.upstreams, http), overrides, prefix, discoveries)
    budgets = budgets if budgets is not None else MemoryBudgets()
    budgets.on_alert = metrics.count_budget_alert
    ledger = ledger if ledger is not None else MemoryUsageLedger()
    gate = TenantGate(limiter, overrides, metrics, budgets)
    watcher = PolicyWatcher(policy_path) if policy_path is not None else None
    adapters = AdapterCatalog(catalog_store if catalog_store is not None else LocalCatalogStore())
    gateway = Gateway(store, fleet, gate, metrics, shared, ledger, adapters, watcher)
    gateway.apply_settings(policy)
    metrics.adapter_label.bases = lambda: fleet.catalog.cached().bases
    metrics.bind(
        queue_depths=admission.queue_depths,
        inflight=admission.inflight,
        breaker_states=lambda: {u.url: u.breaker.state for u in admission.upstreams},
        redis_errors=lambda: int(getattr(limiter, "redis_errors", 0)),
        rolled_back=lambda: {name: store.active.rollouts.is_rolled_back(name) for name in store.active.rollouts.states},
        spills=lambda: admission.spills,
        rollout_weights=lambda: store.active.rollouts.weights(),
        overrides=overrides.describe,
        redis_breakers=lambda: breakers_of(limiter, shared, adapters.store, prefix_store),
        ledger=lambda: {"pending": len(ledger.pending), "dropped": ledger.dropped},
        catalog=adapters.counts,
        prefix=prefix.describe,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if clear_overrides:
            await fleet.clear_overrides()
        with contextlib.suppress(Exception):  # Redis down: the loop retries
            await gateway.housekeeping()  # the fleet's overrides and rollout steps before the first request
        tasks = [
            asyncio.create_task(gateway.background(background_interval_s)),
            asyncio.create_task(fleet.polling_loads()),
        ]
        if discoveries:
            await fleet.discover()  # serve from what DNS says from the first request on
            tasks.append(asyncio.create_task(fleet.discovering()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            gateway.drain()
            with anyio.move_on_after(SHUTDOWN_FLUSH_S):
                await ledger.flush()
            if ledger.pending:
                logger.error(
                    "usage ledger: %d records not written at shutdown (store unreachable)", len(ledger.pending)
                )
            await ledger.aclose()
            await budgets.aclose()
            if own_client:
                await http.aclose()
            await limiter.aclose()
            await shared.aclose()
            await adapters.aclose()
            await prefix.aclose()
            # An open Redis breaker probes Redis from a task of its own (gateway/redis_client.py).
            await stop_probes(breakers_of(limiter, shared, adapters.store, prefix_store))

    proxy = Proxy(http, admission, metrics)
    admin = AdminRoutes(store, fleet, metrics, shared, ledger, adapters)
    routes = [
        *GenerateRoutes(store, gate, fleet, proxy, metrics, ledger, max_body_bytes, adapters).routes(),
        *ApiRoutes(store, gate, fleet, limiter, metrics, adapters).routes(),
        *admin.routes(),
        *AdapterRoutes(adapters, store, fleet, admin.record).routes(),
    ]
    app = Starlette(routes=routes, exception_handlers=HANDLERS, lifespan=lifespan, middleware=[Middleware(HeaderLimit)])
    app.state.gateway = gateway
    return app
