"""A small HTTP/1.1 client on raw asyncio streams, for load from the test process.

One connection per request (`Connection: close`), read to the end: cheap on loopback and far lighter than
an httpx client, which saturates a core before a gateway does on two. Every outcome is counted from the
client's side: an `Answer` (status, headers, body, SSE events) or the exception that replaced it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names; a repeated header keeps its last value
    body: bytes
    elapsed_s: float
    tag: Any = None  # what the caller attached to the request (tenant, priority, ...)

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def events(self) -> list[str]:
        """The data of each Server-Sent Event of a streamed answer."""
        return [line.removeprefix("data: ") for line in self.body.decode().split("\n") if line.startswith("data: ")]

    @property
    def error_type(self) -> str | None:
        try:
            return self.json()["error"]["type"]
        except (ValueError, KeyError, TypeError):
            return None


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += rest[:size]
        data = rest[size + 2 :]
    return bytes(out)


async def request(
    url: str,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: Sequence[tuple[str, str]] | Mapping[str, str] = (),
    timeout_s: float = 60.0,
    tag: Any = None,
) -> Answer:
    """One request on its own connection; raises (OSError, asyncio.TimeoutError, ValueError) if no whole
    answer came back."""
    parts = urlsplit(url)
    started = time.monotonic()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, parts.port), timeout_s)
    try:
        pairs = list(headers.items()) if isinstance(headers, Mapping) else list(headers)
        lines = [f"{method} {path} HTTP/1.1", f"Host: {parts.netloc}", "Connection: close"]
        lines += [f"{name}: {value}" for name, value in pairs]
        if body is not None:
            lines.append(f"Content-Length: {len(body)}")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b""))
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()
    head, sep, payload = data.partition(b"\r\n\r\n")
    if not sep:
        raise ValueError(f"no whole response head: {data[:200]!r}")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    answer_headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        answer_headers[name.strip().lower()] = value.strip()
    if answer_headers.get("transfer-encoding") == "chunked":
        payload = _dechunk(payload)
    return Answer(int(status_line.split()[1]), answer_headers, payload, time.monotonic() - started, tag)


def post_json(
    url: str,
    path: str,
    payload: Any,
    headers: Mapping[str, str] | Sequence[tuple[str, str]] = (),
    timeout_s: float = 60.0,
    tag: Any = None,
) -> Awaitable[Answer]:
    pairs = list(headers.items()) if isinstance(headers, Mapping) else list(headers)
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return request(url, "POST", path, raw, [("Content-Type", "application/json"), *pairs], timeout_s, tag)


@dataclass
class Tally:
    """Every request's one outcome: an Answer, or the exception that stood in for it."""

    answers: list[Answer] = field(default_factory=list)
    failures: list[BaseException] = field(default_factory=list)

    def by_status(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for answer in self.answers:
            counts[answer.status] = counts.get(answer.status, 0) + 1
        return counts


async def _record(tally: Tally, call: Callable[[], Awaitable[Answer]]) -> None:
    try:
        tally.answers.append(await call())
    except Exception as exc:
        tally.failures.append(exc)


async def gather_tally(calls: Sequence[Callable[[], Awaitable[Answer]]], concurrency: int) -> Tally:
    """Closed loop: run `calls` with at most `concurrency` in flight; one outcome each."""
    tally = Tally()
    gate = asyncio.Semaphore(concurrency)

    async def one(call: Callable[[], Awaitable[Answer]]) -> None:
        async with gate:
            await _record(tally, call)

    await asyncio.gather(*(one(call) for call in calls))
    return tally


async def open_loop(calls: Sequence[Callable[[], Awaitable[Answer]]], rate_per_s: float) -> Tally:
    """Open loop: start call i at i / rate_per_s seconds whatever the earlier ones are doing (arrivals do
    not slow down when the server does, as with real clients); one outcome each."""
    tally = Tally()
    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks = []
    for i, call in enumerate(calls):
        delay = start + i / rate_per_s - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_record(tally, call)))
    await asyncio.gather(*tasks)
    return tally
