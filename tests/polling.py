"""Waiting for a condition in tests: one bounded poll, sync and async (a test fails when time runs out)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def poll(probe: Callable[[], T], timeout_s: float = 15.0, interval_s: float = 0.05, what: str = "condition") -> T:
    """The first truthy answer of `probe()`, polled until `timeout_s` (then the test fails)."""
    deadline = time.monotonic() + timeout_s
    while not (answer := probe()):
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s:g} s (last: {answer!r})"
        time.sleep(interval_s)
    return answer


async def wait_until(
    predicate: Callable[[], Any], timeout_s: float = 10.0, interval_s: float = 0.01, what: str = "condition"
) -> None:
    """The same inside an event loop: awaits between probes instead of blocking it."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s:g} s"
        await asyncio.sleep(interval_s)
