"""`serve()`: load the model and run the engine's HTTP app under uvicorn, draining before shutdown."""

from __future__ import annotations

import logging
import time
from typing import Any

import uvicorn

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.server import Api, build_app
from engine.tracing import setup_tracing

logger = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 30  # after SIGTERM, requests in the engine get this long to finish
SHUTDOWN_TIMEOUT_S = 5  # then uvicorn's graceful shutdown: responses still being sent


class _DrainingServer(uvicorn.Server):
    """uvicorn, with a drain phase before its own shutdown.

    On the first SIGTERM/SIGINT the app turns draining (/readyz and new generation requests answer 503
    with `X-Loragate-Reason: draining`) while it keeps listening, so callers learn to go elsewhere
    instead of meeting a refused connection. Once the engine has no request left (or after
    DRAIN_TIMEOUT_S) uvicorn's usual graceful shutdown runs. A second signal skips the drain.
    """

    def __init__(self, config: uvicorn.Config, api: Api) -> None:
        super().__init__(config)
        self._api = api
        self._drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._drain_deadline is not None:
            super().handle_exit(sig, frame)
            return
        self._api.draining = True
        self._drain_deadline = time.monotonic() + DRAIN_TIMEOUT_S
        logger.info("draining: new requests get 503; waiting up to %d s for those in flight",
                    DRAIN_TIMEOUT_S)

    async def on_tick(self, counter: int) -> bool:
        if self._drain_deadline is not None and not self.should_exit:
            stats = self._api.engine.engine.stats()
            idle = stats.num_running + stats.num_waiting == 0
            if idle or time.monotonic() > self._drain_deadline:
                logger.info("drained (%s); shutting down", "idle" if idle else "timeout")
                self.should_exit = True
        return await super().on_tick(counter)


def serve(config: EngineConfig, host: str, port: int, log_level: str = "info") -> None:
    """Load the model, then serve the OpenAI API until SIGINT/SIGTERM (with a graceful drain)."""
    setup_tracing("loragate-engine")
    engine = LLMEngine(config)
    app = build_app(AsyncEngine(engine))
    uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                               timeout_graceful_shutdown=SHUTDOWN_TIMEOUT_S)
    logger.info("serving %s on http://%s:%d/v1", engine.model_name, host, port)
    _DrainingServer(uv_config, app.state.api).run()
