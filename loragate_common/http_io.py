"""HTTP plumbing both servers share: read a JSON body safely, watch for the client leaving, frame SSE.

`read_json` bounds a body's size (413) and refuses what strict JSON cannot carry (400 naming the field);
`unless_disconnected` runs work unless the client goes away first; `sse` frames one Server-Sent Event.
Torch-free: the gateway imports it.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive

from loragate_common.errors import ApiError, bad_request, too_large

MAX_BODY_BYTES = 8 << 20
SSE_DONE = b"data: [DONE]\n\n"  # OpenAI's end-of-stream event

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


async def read_json(request: Request, limit: int = MAX_BODY_BYTES, *, optional: bool = False) -> dict[str, Any]:
    """The request body as a JSON object: 413 past `limit` bytes (declared or read), 400 otherwise.
    `optional`: an empty body is `{}`."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large(limit)
    except ClientDisconnect:  # it left, or the server closed it (body timeout): nobody reads the answer
        raise ApiError(499, "client_gone", "the client disconnected before sending the whole body") from None
    if optional and not body.strip():
        return {}
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise bad_request(f"body: malformed JSON ({exc})") from None
    if not isinstance(data, dict):
        raise bad_request("body: must be a JSON object")
    problem = find_unencodable(data)
    if problem is not None:
        raise bad_request(problem)
    return data


def find_unencodable(data: Any) -> str | None:
    """ "field: problem" for the first value strict JSON cannot carry, or None.

    Python's parser accepts NaN, Infinity and numbers that overflow to inf (1e999), and "\\ud800"-style
    escapes that decode to lone surrogates, which no UTF-8 encoder can write back. Such a value would fail
    later (re-encoding the body for an engine, tokenizing a prompt) as a 500, so it is refused here, at
    the edge, as a 400 naming the field. Iterative: the parser already bounds the nesting depth.
    """
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float):
            if not math.isfinite(value):
                return f"{_shown(path)}: must be a finite number"
        elif isinstance(value, str):
            if not value.isascii() and not _encodable(value):
                return f"{_shown(path)}: invalid Unicode (a lone surrogate escape)"
        elif isinstance(value, dict):
            for key, item in value.items():
                if not key.isascii() and not _encodable(key):
                    return f"{_shown(path)}: a key holds invalid Unicode (a lone surrogate escape)"
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
    return None


def _shown(path: str) -> str:
    return "body" if not path else path if len(path) <= 200 else f"{path[:200]}..."


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Coroutine[Any, Any, T]) -> T:
    """Run `work` unless the client disconnects first (then cancel it and raise ClientGone).

    Only for use after the body has been read: from then on, the ASGI receive channel yields
    nothing but `http.disconnect`.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.wait((task, watcher))
    if task.cancelled():
        raise ClientGone()
    return task.result()


def sse(payload: dict[str, Any]) -> bytes:
    """One Server-Sent Event carrying `payload` as JSON."""
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def list_body(items: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's list shape (GET /v1/models, /v1/adapters)."""
    return {"object": "list", "data": items}
