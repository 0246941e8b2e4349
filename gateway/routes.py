"""The gateway's routes besides generation and administration: the model list, probes, metrics; and the
JSON error handlers every route shares."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.adapter_catalog import AdapterCatalog
from gateway.fleet import Fleet
from gateway.ratelimit import RateLimiter
from gateway.reload import PolicyStore
from gateway.telemetry import GatewayMetrics
from gateway.tenant_gate import TenantGate
from loragate_common.adapter_ids import base_id
from loragate_common.errors import unavailable
from loragate_common.http_io import list_body


class ApiRoutes:
    """GET /v1/models (the models this key may use: the engines' and the catalog's), /healthz, /readyz and
    /metrics."""

    def __init__(
        self,
        store: PolicyStore,
        gate: TenantGate,
        fleet: Fleet,
        limiter: RateLimiter,
        metrics: GatewayMetrics,
        adapters: AdapterCatalog,
    ) -> None:
        self.adapters = adapters
        self.store = store
        self.gate = gate
        self.fleet = fleet
        self.limiter = limiter
        self.metrics = metrics
        self.created = int(time.time())

    def routes(self) -> list[Route]:
        return [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/readyz", self.readyz, methods=["GET"]),
            Route("/metrics", self.metrics_text, methods=["GET"]),
        ]

    async def models(self, request: Request) -> Response:
        active = self.store.active
        tenant = self.gate.tenant(request, active)
        models = await self.fleet.catalog.models()
        base = sorted(models.bases)[0] if models.bases else None
        ids: list[tuple[str, str | None]] = [(b, None) for b in sorted(models.bases)]
        # Catalog ids once each (not the `ID@N` an engine lists once it fetched one); then the engines' own.
        catalog = {e.id for e in self.adapters.listed() if tenant.allows(e.id)}
        engines = {a for a in models.adapters if base_id(a) not in catalog and tenant.allows(base_id(a))}
        ids += [(a, base) for a in sorted(catalog | engines)]
        ids += [(r.name, base) for r in active.policy.rollouts if tenant.allows(r.name)]
        cards = [
            {"id": i, "object": "model", "created": self.created, "owned_by": "loragate", "root": i, "parent": parent}
            for i, parent in ids
        ]
        return JSONResponse(list_body(cards), headers=self.gate.known_headers(tenant.id))

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        if self.fleet.draining:
            raise unavailable("draining", "draining")
        fails_closed = self.store.active.policy.ratelimit.on_redis_error == "closed"
        if fails_closed and not await self.limiter.healthy():
            raise unavailable("the rate limiter's store is unreachable", "ratelimit_unavailable")
        return JSONResponse({"status": "ready"})

    async def metrics_text(self, request: Request) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, headers={"Content-Type": content_type})
