"""`serve()`: run the gateway app under uvicorn, with a graceful drain on SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import uvicorn

from gateway.app import Gateway, build_app
from gateway.policy import Policy, load_policy
from gateway.ratelimit import make_limiter
from gateway.request_context import MAX_HEADER_BYTES
from gateway.rollout import RedisShare
from gateway.telemetry import setup_tracing

logger = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 30.0  # after SIGTERM, requests in flight get this long to finish
SHUTDOWN_TIMEOUT_S = 5  # then uvicorn's own graceful shutdown


class _DrainingServer(uvicorn.Server):
    """uvicorn, with a drain phase first: on the first signal the gateway stops admitting (503 draining,
    /readyz 503) but keeps listening until nothing is in flight or DRAIN_TIMEOUT_S passed; a second signal
    skips the drain."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway, drain_timeout_s: float) -> None:
        super().__init__(config)
        self._gateway = gateway
        self._drain_timeout_s = drain_timeout_s
        self._drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._drain_deadline is not None:
            super().handle_exit(sig, frame)
            return
        self._gateway.drain()
        self._drain_deadline = time.monotonic() + self._drain_timeout_s
        logger.info("draining: new requests get 503; waiting up to %.0f s for those in flight",
                    self._drain_timeout_s)

    async def on_tick(self, counter: int) -> bool:
        if self._drain_deadline is not None and not self.should_exit:
            idle = sum(self._gateway.admission.inflight().values()) == 0
            if idle or time.monotonic() > self._drain_deadline:
                logger.info("drained (%s); shutting down", "idle" if idle else "timeout")
                self.should_exit = True
        return await super().on_tick(counter)


def serve(policy_path: Path, upstreams: list[str], redis_url: str | None, host: str, port: int, *,
          max_body_bytes: int = 1 << 20, log_level: str = "info", policy: Policy | None = None,
          drain_timeout_s: float = DRAIN_TIMEOUT_S) -> None:
    """Serve the gateway until SIGINT/SIGTERM. `policy`, if given, is `policy_path` already loaded."""
    policy = policy if policy is not None else load_policy(policy_path)
    setup_tracing("loragate-gateway")
    limiter = make_limiter(redis_url, policy)
    share = RedisShare(redis_url) if redis_url is not None else None  # rollbacks, shared like the limits
    app = build_app(policy, upstreams, limiter, max_body_bytes=max_body_bytes, policy_path=policy_path,
                    rollback_share=share)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=SHUTDOWN_TIMEOUT_S,
                            http="h11",  # h11 bounds a request head still being received
                            h11_max_incomplete_event_size=MAX_HEADER_BYTES)
    logger.info("gateway on http://%s:%d/v1 in front of %s", host, port, ", ".join(upstreams))
    _DrainingServer(config, app.state.gateway, drain_timeout_s).run()
