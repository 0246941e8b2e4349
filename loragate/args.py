"""Argument types and flags shared by the `loragate` subcommands: positive integers, ports, seconds, the client
connection bounds (loragate_common/http_server.py) and the server's logging flags."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any

from loragate_common.http_server import ConnectionLimits

LOG_LEVELS = ("debug", "info", "warning", "error")
SubParsers = argparse._SubParsersAction  # argparse's type for `add_subparsers()`


def checked(parse: Callable[[str], Any], check: Callable[[Any], str | None] | None = None) -> Callable[[str], Any]:
    """An argparse type from a parser and a rule (the problem, or None): a value either breaks is a usage error that
    says why."""

    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
        problem = None if check is None else check(value)
        if problem is not None:
            raise argparse.ArgumentTypeError(f"{text!r}: {problem}")
        return value

    return convert


def _at_least(minimum: int) -> Callable[[Any], str | None]:
    return lambda value: None if value >= minimum else f"expected an integer >= {minimum}"


positive = checked(int, _at_least(1))
port = checked(int, lambda value: None if 1 <= value <= 65535 else "a port is in 1..65535")
seconds = checked(float, lambda value: None if 0 < value < float("inf") else "expected a positive number of seconds")


def add_connection_args(p: argparse.ArgumentParser) -> None:
    """Bounds on client connections (loragate_common/http_server.py), shared by engine and gateway."""
    defaults = ConnectionLimits()
    p.add_argument(
        "--header-timeout-s",
        type=seconds,
        default=defaults.header_timeout_s,
        help="a connection must send a complete request head within this (else 408, closed)",
    )
    p.add_argument(
        "--body-timeout-s",
        type=seconds,
        default=defaults.body_timeout_s,
        help="a request's body must arrive within this after its head (else 408, closed)",
    )
    p.add_argument(
        "--keep-alive-s",
        type=seconds,
        default=defaults.keep_alive_s,
        help="idle keep-alive connections close after this",
    )
    p.add_argument(
        "--max-connections",
        type=positive,
        default=defaults.max_connections,
        help="client connections open at once; more are answered 503 and closed",
    )


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    return ConnectionLimits(args.header_timeout_s, args.body_timeout_s, args.keep_alive_s, args.max_connections)


def add_logging_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    p.add_argument(
        "--log-probes",
        action="store_true",
        help="also log each request to /healthz, /readyz, /load and /metrics (load balancers, the gateway's load poll "
        "and Prometheus call them every few seconds; off by default)",
    )


def setup_logging(level: str) -> None:
    """The process's log format and level. httpx logs every request it sends at INFO (the gateway's proxied requests
    and load polls): those lines show at debug only."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level != "debug":
        logging.getLogger("httpx").setLevel(logging.WARNING)
