"""`serve()`: load the model and run the engine's HTTP app (loragate_common/http_server.py: client bounds, drain)."""

from __future__ import annotations

import logging

from engine.config import EngineConfig
from engine.core.async_engine import AsyncEngine
from engine.entrypoints.server import build_app
from loragate_common.http_server import ConnectionLimits, serve_app
from loragate_common.tracing import setup_tracing

logger = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 30  # after SIGTERM, requests in the engine get this long to finish


def serve(
    config: EngineConfig,
    host: str,
    port: int,
    log_level: str = "info",
    limits: ConnectionLimits | None = None,
    log_probes: bool = False,
) -> None:
    """Load the model, then serve the OpenAI API until SIGINT/SIGTERM (with a graceful drain). `limits`: the
    client bounds (None: ConnectionLimits' defaults); `log_probes`: log /healthz, /readyz, /load and /metrics too.

    On the first signal new generation requests and /readyz answer 503 `draining`; once the engine holds
    no request (or after DRAIN_TIMEOUT_S) the server shuts down.
    """
    setup_tracing("loragate-engine")
    async_engine = AsyncEngine.load(config)  # the model is loaded in the engine thread
    engine = async_engine.engine
    app = build_app(async_engine)
    api = app.state.api

    def begin_drain() -> None:
        api.draining = True

    def is_idle() -> bool:
        stats = engine.stats()
        return stats.num_running + stats.num_waiting == 0

    logger.info("serving %s on http://%s:%d/v1", engine.model_name, host, port)
    serve_app(
        app,
        host,
        port,
        begin_drain=begin_drain,
        is_idle=is_idle,
        drain_timeout_s=DRAIN_TIMEOUT_S,
        limits=limits if limits is not None else ConnectionLimits(),
        log_level=log_level,
        log_probes=log_probes,
    )
