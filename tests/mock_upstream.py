"""A fake engine replica for gateway tests: a real HTTP server on 127.0.0.1 (uvicorn in a thread).

It answers the engine's OpenAI surface (/v1/models, /v1/completions, /v1/chat/completions, /healthz) with
canned text: the completion is the tokens "t0 t1 t2 ..." (`tokens` of them), streamed one chunk per token
every `token_interval_s`, with the usage chunk when `stream_options.include_usage` is set. Its behaviour
can be changed while it runs (`mock.behavior.<field> = ...`), and it records every generation request it
receives (path, headers, body) in `mock.received`:

    with MockUpstream() as mock:                # or mock = MockUpstream().start(); ...; mock.stop()
        mock.behavior.fail_status = 500         # answer 500
        mock.behavior.fail_adapters = frozenset({"a2"})   # answer 500 to requests for adapter a2 only
        mock.behavior.drop_before_first_byte = True   # send headers, then close the connection
        mock.behavior.die_after_chunks = 3      # stream 3 token chunks, then close the connection
        mock.behavior.delay_s = 0.5             # wait before answering
        mock.behavior.pause_after_chunks = 1    # stream 1 chunk, then wait for mock.resume()
        mock.hold()  / mock.release()           # park requests until released
        mock.count, mock.received[0].headers["traceparent"], mock.streams_aborted
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from processes import serve_in_thread

BASE_MODEL = "mock-base"
PROMPT_TOKENS = 5


@dataclass
class Behavior:
    fail_status: int | None = None  # answer generation requests with this status (JSON error body)
    fail_adapters: frozenset[str] = frozenset()  # answer 500 to requests for these adapters (X-Adapter-ID)
    drop_before_first_byte: bool = False  # start the response, then close the connection
    die_after_chunks: int | None = None  # stream this many token chunks, then close the connection
    delay_s: float = 0.0  # sleep before answering
    tokens: int = 8  # completion length
    token_interval_s: float = 0.005  # between stream chunks
    pause_after_chunks: int | None = None  # stream this many chunks, then wait for `resume()`
    # An engine's load report (running, waiting, adapters on its device): GET /load answers it, and every
    # generation answer carries it as X-Loragate-Load. None: no /load route (404) and no header.
    load: tuple[int, int, tuple[str, ...]] | None = None
    prefixes: tuple[str, ...] = ()  # the prompt chunk hashes GET /load says its prefix cache holds


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]  # lower-case names
    body: dict[str, Any]
    at: float = field(default_factory=time.monotonic)


class _BrokenOnPurpose(Exception):
    """Raised after the response started: uvicorn then closes the connection mid-response."""


class MockUpstream:
    def __init__(
        self,
        adapters: tuple[str, ...] = ("a1", "a2"),
        base_model: str = BASE_MODEL,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.host, self.port = host, port  # where it listens (port 0: a free one)
        self.adapters = adapters
        self.base_model = base_model
        self.behavior = Behavior()
        self.received: list[Received] = []
        self._lock = threading.Lock()
        self._open = threading.Event()
        self._open.set()
        self._resume = threading.Event()
        self.streams_finished = 0  # streams that sent [DONE]
        self.streams_aborted = 0  # streams cancelled because the client (the gateway) went away
        self.load_polls = 0  # GET /load requests answered
        self._serving = contextlib.ExitStack()
        self.url = ""

    # ---- lifecycle ----
    def start(self) -> MockUpstream:
        self.url = self._serving.enter_context(
            serve_in_thread(self._app(), log_level="critical", lifespan="off", host=self.host, port=self.port)
        )
        return self

    def stop(self) -> None:
        self._open.set()
        self._resume.set()
        self._serving.close()

    def __enter__(self) -> MockUpstream:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- control ----
    def hold(self) -> None:
        """Park every generation request (after recording it) until `release()`."""
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def resume(self) -> None:
        """Let streams paused by `pause_after_chunks` go on."""
        self._resume.set()

    @property
    def count(self) -> int:
        with self._lock:
            return len(self.received)

    def reset(self) -> None:
        with self._lock:
            self.received.clear()
        self.behavior = Behavior()

    # ---- the app ----
    def _app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/completions", self._generate, methods=["POST"]),
                Route("/v1/chat/completions", self._generate, methods=["POST"]),
                Route("/healthz", self._healthz, methods=["GET"]),
                Route("/load", self._load, methods=["GET"]),
            ]
        )

    async def _load(self, request: Request) -> Response:
        self.load_polls += 1
        load = self.behavior.load
        if load is None:
            return JSONResponse({"error": {"type": "not_found", "message": "no /load"}}, status_code=404)
        running, waiting, device = load
        return JSONResponse(
            {
                "running": running,
                "waiting": waiting,
                "device_adapters": list(device),
                "max_device_adapters": 8,
                "prefixes": list(self.behavior.prefixes),
            }
        )

    def _load_header(self) -> dict[str, str]:
        load = self.behavior.load
        return {} if load is None else {"X-Loragate-Load": f"running={load[0]}, waiting={load[1]}, pool=0.10"}

    async def _healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def _models(self, request: Request) -> Response:
        cards = [{"id": self.base_model, "object": "model", "parent": None}]
        cards += [{"id": a, "object": "model", "parent": self.base_model} for a in self.adapters]
        return JSONResponse({"object": "list", "data": cards})

    async def _generate(self, request: Request) -> Response:
        body = json.loads(await request.body())
        with self._lock:
            self.received.append(Received(request.url.path, dict(request.headers), body))
        while not self._open.is_set():
            await asyncio.sleep(0.005)
        behavior = self.behavior
        if behavior.delay_s:
            await asyncio.sleep(behavior.delay_s)
        failing = request.headers.get("x-adapter-id") in behavior.fail_adapters
        if behavior.fail_status is not None or failing:
            return JSONResponse(
                {"error": {"type": "mock_error", "message": "failing on purpose"}},
                status_code=behavior.fail_status or 500,
            )
        chat = request.url.path.endswith("chat/completions")
        model = request.headers.get("x-adapter-id") or body.get("model") or self.base_model
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(
                self._events(behavior, chat, model, usage), media_type="text/event-stream", headers=self._load_header()
            )
        if behavior.drop_before_first_byte:
            return StreamingResponse(self._nothing(), media_type="application/json")
        text = "".join(f"t{i} " for i in range(behavior.tokens))
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
            if chat
            else {"index": 0, "text": text, "finish_reason": "length"}
        )
        return JSONResponse(
            {
                "id": "mock-1",
                "object": "chat.completion" if chat else "text_completion",
                "created": 0,
                "model": model,
                "choices": [choice],
                "usage": _usage(behavior.tokens),
            },
            headers=self._load_header(),
        )

    async def _nothing(self) -> AsyncIterator[bytes]:
        raise _BrokenOnPurpose("closing before the first byte")
        yield b""  # pragma: no cover - makes this an async generator

    async def _events(self, behavior: Behavior, chat: bool, model: str, usage: bool) -> AsyncIterator[bytes]:
        if behavior.drop_before_first_byte:
            raise _BrokenOnPurpose("closing before the first byte")
        try:
            async for event in self._chunks(behavior, chat, model, usage):
                yield event
        except (asyncio.CancelledError, GeneratorExit):
            self.streams_aborted += 1
            raise
        self.streams_finished += 1

    async def _chunks(self, behavior: Behavior, chat: bool, model: str, usage: bool) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        for i in range(behavior.tokens):
            if i == behavior.pause_after_chunks:
                while not self._resume.is_set():
                    await asyncio.sleep(0.005)
            if behavior.die_after_chunks is not None and i >= behavior.die_after_chunks:
                raise _BrokenOnPurpose(f"dying after {i} chunks")
            last = i == behavior.tokens - 1
            choice = (
                {"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": "length" if last else None}
                if chat
                else {"index": 0, "text": f"t{i} ", "finish_reason": "length" if last else None}
            )
            chunk: dict[str, Any] = {"id": "mock-1", "object": obj, "created": 0, "model": model, "choices": [choice]}
            if usage:
                chunk["usage"] = None
            yield _sse(chunk)
            await asyncio.sleep(behavior.token_interval_s)
        if usage:
            yield _sse(
                {
                    "id": "mock-1",
                    "object": obj,
                    "created": 0,
                    "model": model,
                    "choices": [],
                    "usage": _usage(behavior.tokens),
                }
            )
        yield b"data: [DONE]\n\n"


def _usage(completion: int) -> dict[str, int]:
    return {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": completion, "total_tokens": PROMPT_TOKENS + completion}


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"
