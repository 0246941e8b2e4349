"""Serving a Starlette app under uvicorn: bounded client connections, and a drain before shutdown.

Both the engine and the gateway serve through `serve_app`. It adds two things to uvicorn:

- **Bounds on clients** (`ConnectionLimits`, `GuardedH11Protocol`). uvicorn bounds neither how long a client
  may take to send a request's head or body nor how many connections may be open: a client that opens
  connections and sends nothing, or sends one byte every few seconds (slowloris), holds a socket and a
  little memory each, indefinitely. Here a connection gets `header_timeout_s` from its first byte (or from
  being opened) to a complete request head, and `body_timeout_s` from the head to the end of the body;
  past either it is answered 408 (when nothing was answered yet) and closed. Idle keep-alive connections
  close after `keep_alive_s` (uvicorn's own timer). Past `max_connections` open at once, a new connection
  is answered 503 and closed at once.
- **A drain** (`DrainingServer`): on the first SIGTERM/SIGINT the app turns draining (it answers new work
  503 `draining`, and /readyz 503) while it keeps listening, so callers learn to go elsewhere instead of
  meeting a refused connection; once idle (or after `drain_timeout_s`) uvicorn's graceful shutdown runs.
  A second signal skips the drain.
- **Quiet probes** (`ProbeFilter`): uvicorn's access log leaves out requests to the paths load balancers, the
  gateway's load poll and Prometheus call every few seconds (PROBE_PATHS), unless `log_probes`: at the default level
  an operator's terminal shows requests, not polls.

This module is torch-free: the gateway imports it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 * 1024  # a request head still being received is refused past this (h11's bound)
SHUTDOWN_TIMEOUT_S = 5  # after the drain: uvicorn's graceful shutdown, for responses still being sent


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What one client connection may take (CLI: --header-timeout-s, --body-timeout-s, --max-connections)."""

    header_timeout_s: float = 10.0  # opened or first byte -> a complete request head
    body_timeout_s: float = 30.0  # request head -> the end of its body
    keep_alive_s: float = 5.0  # idle between two requests on one connection
    max_connections: int = 1024  # open at once; more are answered 503 and closed

    def validate(self) -> None:
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0 and self.keep_alive_s > 0):
            raise ValueError("connection timeouts must be positive")
        if self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")


def _raw_response(status: int, reason: str, type_: str, message: str) -> bytes:
    """A whole JSON error response, written straight to a connection that is closed right after."""
    body = json.dumps({"error": {"type": type_, "message": message}}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each phase of receiving a request, and a connection cap.

    The phase follows h11's view of the client: IDLE until the request head is complete ("head"), then
    SEND_BODY until the body ends ("body"), then nothing to wait for. A deadline covers a whole phase, not
    the gap between two bytes, so trickling bytes does not extend it.
    """

    limits = ConnectionLimits()  # set on the subclass `guarded_protocol` makes

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # as uvicorn's
        super().connection_made(transport)
        self._phase: str | None = None
        self._deadline: asyncio.TimerHandle | None = None
        if len(self.connections) > self.limits.max_connections:
            logger.warning(
                "refusing a connection: %d open (--max-connections %d)",
                len(self.connections) - 1,
                self.limits.max_connections,
            )
            transport.write(
                _raw_response(
                    503, "Service Unavailable", "service_unavailable", "too many open connections; retry later"
                )
            )
            transport.close()
            return
        self._enter("head")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state
        self._enter("head" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None)

    def connection_lost(self, exc: Exception | None) -> None:
        self._enter(None)
        super().connection_lost(exc)

    def _enter(self, phase: str | None) -> None:
        if phase == self._phase:
            return  # the same phase goes on: its deadline stands
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if phase is not None:
            timeout = self.limits.header_timeout_s if phase == "head" else self.limits.body_timeout_s
            self._deadline = self.loop.call_later(timeout, self._expired, phase)

    def _expired(self, phase: str) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        timeout = self.limits.header_timeout_s if phase == "head" else self.limits.body_timeout_s
        logger.info(
            "closing a connection from %s: its request %s took over %g s",
            self.client,
            "head" if phase == "head" else "body",
            timeout,
        )
        if self.cycle is None or not self.cycle.response_started:
            what = "headers" if phase == "head" else "body"
            self.transport.write(
                _raw_response(
                    408, "Request Timeout", "request_timeout", f"the request {what} did not arrive within {timeout:g} s"
                )
            )
        if self.cycle is not None and phase == "body":  # the app reading the body sees a disconnect
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.transport.close()


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn instantiates per connection, bound to `limits`."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})


class DrainingServer(uvicorn.Server):
    """uvicorn with a drain phase before its own shutdown (see the module docstring).

    `begin_drain()` makes the app refuse new work; `is_idle()` says nothing is in flight any more.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        begin_drain: Callable[[], None],
        is_idle: Callable[[], bool],
        drain_timeout_s: float,
    ) -> None:
        super().__init__(config)
        self._begin_drain = begin_drain
        self._is_idle = is_idle
        self._drain_timeout_s = drain_timeout_s
        self._drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._drain_deadline is not None:
            super().handle_exit(sig, frame)
            return
        self._begin_drain()
        self._drain_deadline = time.monotonic() + self._drain_timeout_s
        logger.info("draining: new requests get 503; waiting up to %.0f s for those in flight", self._drain_timeout_s)

    async def on_tick(self, counter: int) -> bool:
        if self._drain_deadline is not None and not self.should_exit:
            idle = self._is_idle()
            if idle or time.monotonic() > self._drain_deadline:
                logger.info("drained (%s); shutting down", "idle" if idle else "timeout")
                self.should_exit = True
        return await super().on_tick(counter)


PROBE_PATHS = frozenset({"/healthz", "/readyz", "/load", "/metrics"})


class ProbeFilter(logging.Filter):
    """Drops uvicorn access-log records of requests to PROBE_PATHS (a query string included)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].partition("?")[0] not in PROBE_PATHS
        return True


def serve_app(
    app: Any,
    host: str,
    port: int,
    *,
    begin_drain: Callable[[], None],
    is_idle: Callable[[], bool],
    drain_timeout_s: float,
    limits: ConnectionLimits = ConnectionLimits(),
    log_level: str = "info",
    log_probes: bool = False,
) -> None:
    """Serve `app` on host:port until SIGINT/SIGTERM, with the client bounds, the drain and the quiet probes above."""
    limits.validate()
    access = logging.getLogger("uvicorn.access")
    for old in [f for f in access.filters if isinstance(f, ProbeFilter)]:
        access.removeFilter(old)
    if not log_probes:
        access.addFilter(ProbeFilter())
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=guarded_protocol(limits),
        timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]  # uvicorn's call_later takes a float
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        timeout_graceful_shutdown=SHUTDOWN_TIMEOUT_S,
    )
    DrainingServer(config, begin_drain, is_idle, drain_timeout_s).run()
