"""The vLLM agent's HTTP app and `serve` (loragate_common/http_server.py: client bounds, a drain on SIGTERM).

The agent runs beside a vLLM OpenAI server started with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and shares a volume
with it: it fetches catalog adapters into the disk cache there and has vLLM load them under their ref `ID@N`
(vllm_agent/loader.py). Every error is `{"error": {"type", "message"}}` (loragate_common/errors.py).

POST /v1/adapters/ensure
    Headers as the gateway sends them to engines: `X-Adapter-ID: ID@N` (an id or ref by loragate_common/adapter_ids.py's
    rules, once), `X-Adapter-Source: URI`, `X-Adapter-SHA256: <64 hex>`, optionally `X-Adapter-Size: <bytes>`; no
    body. Makes the adapter fetched into the disk cache (one download however many requests wait) and loaded into
    vLLM as `ID@N` (one load however many wait); an id vLLM already lists, or that vLLM answers "has already been
    loaded", counts as loaded.
    200 {"id": "ID@N", "sha256", "state": "loaded", "download_s", "load_s"}: the seconds the download and vLLM's load
        took when this agent did them; null when the adapter was on disk, or in vLLM, before the agent started.
    400 invalid_request_error      a header missing or malformed; the message names it
    403 adapter_source_not_allowed the source is not under --adapter-source-allow
    502 adapter_fetch_failed       the download failed (not tried again before its backoff: Retry-After), or vLLM
                                   refused the adapter (its own message; with runtime loading off, the message says
                                   to start vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); X-Loragate-Reason
    503 service_unavailable        X-Loragate-Reason `adapter_loading`: the request waited --adapter-load-wait-s, the
                                   download or load goes on (Retry-After: 2); `upstream_unavailable`: vLLM did not
                                   answer (Retry-After: 2)
GET /v1/adapters
    {"object": "list", "data": [card, ...]}, a card per cache entry and id known for it: {"id" (null when no id is
    known), "object": "adapter", "sha256", "source", "state": downloading | failed | disk | loaded, "error",
    "download_s", "load_s", "last_used" (unix seconds)}
GET /healthz    200 {"status": "ok"} while the process runs
GET /readyz     200 {"status": "ready"} when vLLM's GET /health answers 200; else 503 `upstream_unavailable`
                (`draining` once the agent is stopping)
GET /metrics    Prometheus text (vllm_agent/metrics.py)
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loragate_common.adapter_ids import check_ref
from loragate_common.errors import HANDLERS, bad_request, unavailable
from loragate_common.fetched import wanted_from_headers
from loragate_common.http_io import list_body
from loragate_common.http_server import ConnectionLimits, serve_app
from vllm_agent.config import AgentConfig
from vllm_agent.loader import UNAVAILABLE_RETRY_AFTER_S, VllmAdapters
from vllm_agent.metrics import AgentMetrics
from vllm_agent.vllm import VllmClient

logger = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 30.0  # after SIGTERM, ensures in flight get this long to finish


class AgentRoutes:
    """The agent's routes (the module docstring); counts ensures in flight for the drain."""

    def __init__(self, adapters: VllmAdapters, metrics: AgentMetrics) -> None:
        self.adapters = adapters
        self.metrics = metrics
        self.draining = False
        self.in_flight = 0

    def routes(self) -> list[Route]:
        return [
            Route("/v1/adapters/ensure", self.ensure, methods=["POST"]),
            Route("/v1/adapters", self.list_adapters, methods=["GET"]),
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/readyz", self.readyz, methods=["GET"]),
            Route("/metrics", self.metrics_text, methods=["GET"]),
        ]

    async def ensure(self, request: Request) -> Response:
        adapter_id = _adapter_ref(request)
        wanted = wanted_from_headers(request)
        if wanted is None:
            raise bad_request("X-Adapter-Source: required (the adapter's source URI, with X-Adapter-SHA256)")
        self.in_flight += 1
        try:
            card = await self.adapters.ensure(adapter_id, wanted)
        finally:
            self.in_flight -= 1
        return JSONResponse(card)

    async def list_adapters(self, request: Request) -> Response:
        return JSONResponse(list_body(self.adapters.cards()))

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        if self.draining:
            raise unavailable("draining", "draining")
        vllm = self.adapters.vllm
        if not await vllm.healthy():
            self.adapters.vllm_lost()
            raise unavailable(
                f"vLLM at {vllm.base_url} is not healthy", "upstream_unavailable", UNAVAILABLE_RETRY_AFTER_S
            )
        return JSONResponse({"status": "ready"})

    async def metrics_text(self, request: Request) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, headers={"Content-Type": content_type})

    def drain(self) -> None:
        self.draining = True

    def is_idle(self) -> bool:
        return self.in_flight == 0


def _adapter_ref(request: Request) -> str:
    values = request.headers.getlist("x-adapter-id")
    if len(values) != 1:
        raise bad_request("X-Adapter-ID: required once (the adapter's ref, ID@N)")
    value = values[0].strip()
    check_ref(value, "X-Adapter-ID")
    return value


def build_app(config: AgentConfig, *, vllm_transport: httpx.AsyncBaseTransport | None = None) -> Starlette:
    """The agent's app; its lifespan reads what vLLM already loaded and closes the client to vLLM."""
    metrics = AgentMetrics()
    vllm = VllmClient(config.vllm_url, config.vllm_timeout_s, config.vllm_load_timeout_s, transport=vllm_transport)
    adapters = VllmAdapters(config, vllm, metrics)
    metrics.bind_cache(adapters.cache)
    agent = AgentRoutes(adapters, metrics)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await adapters.start()
        yield
        await adapters.close()

    app = Starlette(routes=agent.routes(), exception_handlers=HANDLERS, lifespan=lifespan)
    app.state.agent = agent
    return app


def serve(
    config: AgentConfig,
    host: str,
    port: int,
    *,
    log_level: str = "info",
    limits: ConnectionLimits | None = None,
    log_probes: bool = False,
    drain_timeout_s: float = DRAIN_TIMEOUT_S,
) -> None:
    """Serve the agent until SIGINT/SIGTERM; on the first signal /readyz turns 503 while ensures in flight finish."""
    app = build_app(config)
    agent: AgentRoutes = app.state.agent
    logger.info("vLLM agent on http://%s:%d beside vLLM at %s, cache %s", host, port, config.vllm_url, config.cache_dir)
    serve_app(
        app,
        host,
        port,
        begin_drain=agent.drain,
        is_idle=agent.is_idle,
        drain_timeout_s=drain_timeout_s,
        limits=limits if limits is not None else ConnectionLimits(),
        log_level=log_level,
        log_probes=log_probes,
    )
