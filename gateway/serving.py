"""`serve()`: run the gateway app (loragate_common/http_server.py: client bounds, a graceful drain on SIGTERM)."""

from __future__ import annotations

import logging
from pathlib import Path

from gateway.app import build_app
from gateway.budgets import RedisBudgets
from gateway.catalog_store import RedisCatalogStore
from gateway.discovery import DnsUpstreams
from gateway.fleet_store import RedisFleetStore
from gateway.policy import Policy, load_policy
from gateway.prefix_index import RedisPrefixStore
from gateway.ratelimit import MemoryRateLimiter, RateLimiter
from gateway.redis_limiter import RedisRateLimiter
from gateway.usage import RETENTION, RedisUsageLedger
from loragate_common.http_server import ConnectionLimits, serve_app
from loragate_common.tracing import setup_tracing

logger = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 30.0  # after SIGTERM, requests in flight get this long to finish


def make_limiter(redis_url: str | None, policy: Policy) -> RateLimiter:
    """In-process limits without a Redis URL; shared limits across replicas with one."""
    if redis_url is None:
        return MemoryRateLimiter()
    return RedisRateLimiter(redis_url, on_error=policy.ratelimit.on_redis_error)


def serve(
    policy_path: Path,
    upstreams: list[str],
    redis_url: str | None,
    host: str,
    port: int,
    *,
    max_body_bytes: int = 1 << 20,
    log_level: str = "info",
    policy: Policy | None = None,
    drain_timeout_s: float = DRAIN_TIMEOUT_S,
    limits: ConnectionLimits | None = None,
    discovery: list[DnsUpstreams] | None = None,
    clear_overrides: bool = False,
    usage_retention: int = RETENTION,
    log_probes: bool = False,
) -> None:
    """Serve the gateway until SIGINT/SIGTERM. `policy`, if given, is `policy_path` already loaded.

    On the first signal the gateway stops admitting (503 draining, /readyz 503) but keeps listening until
    nothing is in flight or `drain_timeout_s` passed. `log_probes`: log /healthz, /readyz, /load and /metrics too.
    """
    policy = policy if policy is not None else load_policy(policy_path)
    setup_tracing("loragate-gateway")
    limiter = make_limiter(redis_url, policy)
    # With Redis, everything the replicas must agree on is shared like the limits: rollouts and overrides,
    # the usage ledger, budgets, the adapter catalog, which engine holds which prompt prefix. Without it, each
    # lives in this process (build_app's defaults).
    shared = ledger = budgets = catalog = prefix = None
    if redis_url is not None:
        shared = RedisFleetStore(redis_url)
        ledger = RedisUsageLedger(redis_url, retention=usage_retention)
        budgets = RedisBudgets(redis_url)
        catalog = RedisCatalogStore(redis_url)
        prefix = RedisPrefixStore(redis_url)
    app = build_app(
        policy,
        upstreams,
        limiter,
        max_body_bytes=max_body_bytes,
        policy_path=policy_path,
        fleet_store=shared,
        ledger=ledger,
        budgets=budgets,
        discovery=discovery,
        clear_overrides=clear_overrides,
        catalog_store=catalog,
        prefix_store=prefix,
    )
    gateway = app.state.gateway
    engines = list(upstreams) + [str(d) for d in discovery or ()]
    logger.info("gateway on http://%s:%d/v1 in front of %s", host, port, ", ".join(engines))
    serve_app(
        app,
        host,
        port,
        begin_drain=gateway.drain,
        is_idle=gateway.fleet.is_idle,
        drain_timeout_s=drain_timeout_s,
        limits=limits if limits is not None else ConnectionLimits(),
        log_level=log_level,
        log_probes=log_probes,
    )
