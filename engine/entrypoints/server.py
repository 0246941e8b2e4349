"""The engine's OpenAI-compatible HTTP API (Starlette); `engine.entrypoints.serving.serve()` runs it under uvicorn.

One request's path: read and validate the JSON body (400 naming the field) -> adapter and priority from
the headers / `model` -> tokenize -> `AsyncEngine.generate` -> one JSON response, or Server-Sent Events
that carry each engine step's text as soon as it exists. A client that goes away aborts its request,
which frees its KV blocks. Every error is JSON: {"error": {"type": ..., "message": ...}}.

Adapters: a request names one with `X-Adapter-ID` or `model`; any id that is not registered (hostile
ones included: they can never be registered) is a 404, never the base model. The /v1/adapters admin
routes, which load and unload them at run time, are in engine/entrypoints/adapter_routes.py.

Load: GET /load and the `X-Loragate-Load` header of every generation answer (errors included) report the
engine's requests running and waiting and its pool use, for the gateway's routing (gateway/admission.py
EngineLoad). Both read the report the engine thread publishes after each step (`LLMEngine.load_report`):
one attribute read, no round trip to the engine thread.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any

import anyio
from jinja2 import TemplateError
from opentelemetry.trace import Span
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.core.async_engine import AsyncEngine, EngineDeadError, RequestFailed
from engine.core.outputs import LoadReport, RequestOutput
from engine.core.request import TokenLogprob
from engine.entrypoints.adapter_routes import AdapterRoutes
from engine.entrypoints.fetched_adapters import FetchedAdapters, wanted_from_headers
from engine.entrypoints.metrics import EngineMetrics, RequestTracker
from engine.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from engine.entrypoints.responses import ChatFormatter, CompletionFormatter, Formatter, model_card
from engine.entrypoints.tracing import engine_span, record_error, record_output
from engine.lora.peft_config import AdapterError, validate_adapter_id
from loragate.errors import ApiError, adapter_not_found, bad_request, error_body, error_response, unavailable
from loragate.http_io import SSE_DONE, ClientGone, list_body, read_json, sse, unless_disconnected
from loragate.priority import Priority

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 5
_GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

GenerationRequest = CompletionRequest | ChatCompletionRequest


def load_header(report: LoadReport) -> dict[str, str]:
    """`X-Loragate-Load: running=R, waiting=W, pool=0.41`: comma-separated name=value fields (the gateway reads
    running and waiting, and ignores fields it does not know)."""
    return {"X-Loragate-Load": f"running={report.running}, waiting={report.waiting}, pool={report.pool_used:.2f}"}


def _unavailable(message: str, reason: str) -> ApiError:
    """A 503: `reason` is "draining" (SIGTERM, shutting down) or "engine_failure" (the loop is down)."""
    return unavailable(message, reason, RETRY_AFTER_S)


@contextlib.contextmanager
def _engine_errors(adapter_id: str | None) -> Iterator[None]:
    """Map what `AsyncEngine.generate` and its outputs raise to HTTP errors."""
    try:
        yield
    except ValueError as exc:  # the request can never run here (too long, bad token ids, ...)
        raise bad_request(str(exc)) from None
    except KeyError:
        if adapter_id is None:
            raise
        raise adapter_not_found(adapter_id) from None
    except RequestFailed as exc:  # this request alone: its adapter is broken, or computing it failed
        raise ApiError(500, exc.type, exc.message) from None
    except EngineDeadError as exc:
        raise _unavailable(str(exc), exc.reason) from None


def _priority(request: Request) -> Priority:
    try:
        return Priority.parse(request.headers.get("x-priority"))
    except ValueError as exc:
        raise bad_request(str(exc)) from None


async def close_outputs(it: AsyncIterator[RequestOutput]) -> None:
    """Close the engine's output iterator: if the request is still running, this aborts it."""
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):  # runs even while the stream's task is being cancelled
            await aclose()


async def _next(it: AsyncIterator[RequestOutput], adapter_id: str | None) -> RequestOutput:
    with _engine_errors(adapter_id):
        return await anext(it)


async def _collect(
    it: AsyncIterator[RequestOutput], first: RequestOutput, tracker: RequestTracker
) -> tuple[str, list[TokenLogprob], RequestOutput]:
    texts: list[str] = []
    logprobs: list[TokenLogprob] = []
    out = first
    while True:
        tracker.on_output(out)
        texts.append(out.new_text)
        logprobs.extend(out.new_logprobs)
        if out.finished:
            return "".join(texts), logprobs, out
        out = await _next(it, None)


class EngineRoutes:
    """The engine's route handlers but the /v1/adapters ones (AdapterRoutes): the OpenAI API (completions, chat
    completions, models), the probes and /metrics; one instance per app, bound to one engine."""

    def __init__(self, engine: AsyncEngine, metrics: EngineMetrics, fetched: FetchedAdapters) -> None:
        self.engine = engine
        self.metrics = metrics
        self.fetched = fetched
        self.draining = False  # set on SIGTERM: stop admitting, let in-flight requests finish
        self.tokenizer = engine.engine.tokenizer
        self.base_model = engine.engine.model_name
        self.max_model_len = engine.engine.max_model_len
        self.max_num_seqs = engine.engine.config.max_num_seqs
        self.created = int(time.time())
        self.token_text: Callable[[int], str] = functools.lru_cache(maxsize=1 << 16)(self._token_text)

    def _token_text(self, token_id: int) -> str:
        text = self.tokenizer.decode([token_id])
        if not isinstance(text, str):  # never: decode gives a list only for a batch of sequences
            raise TypeError(f"the tokenizer decoded one token to {type(text).__name__}, not str")
        return text

    async def completions(self, request: Request) -> Response:
        req = parse_body(CompletionRequest, await read_json(request))
        adapter_id = self._adapter_id(request, req.model)
        prompt = req.prompt
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        fmt = CompletionFormatter(adapter_id or self.base_model, self.token_text, req.logprobs is not None)
        return await self._generate(request, req, prompt_ids, fmt, adapter_id)

    async def chat_completions(self, request: Request) -> Response:
        req = parse_body(ChatCompletionRequest, await read_json(request))
        adapter_id = self._adapter_id(request, req.model)
        prompt_ids = self._chat_prompt(req)
        fmt = ChatFormatter(adapter_id or self.base_model, self.token_text, bool(req.logprobs))
        return await self._generate(request, req, prompt_ids, fmt, adapter_id)

    def _adapter_id(self, request: Request, model: str | None) -> str | None:
        """X-Adapter-ID wins over `model`; neither, or the base model's name, means the base model.

        An id that could never be registered is answered 404 here, before it reaches the engine.
        """
        named = request.headers.getlist("x-adapter-id")
        if len(named) > 1:
            raise bad_request("X-Adapter-ID: given more than once; name one adapter")
        name = (named[0] if named else "").strip() or (model or "").strip()
        if name in ("", self.base_model):
            return None
        try:
            return validate_adapter_id(name)
        except AdapterError:
            raise adapter_not_found(name) from None

    def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("messages: the served model has no chat template; use /v1/completions")
        try:
            encoded = self.tokenizer.apply_chat_template(
                req.template_messages(), add_generation_prompt=True, tokenize=True
            )
        except TemplateError as exc:  # the template rejects the conversation (e.g. role order)
            raise bad_request(f"messages: {exc}") from None
        # transformers 5 returns a BatchEncoding; older versions a plain list of ids. int() checks each id.
        ids: list[Any] = list(encoded["input_ids"] if isinstance(encoded, Mapping) else encoded)
        if ids and isinstance(ids[0], list):  # a batch of one conversation
            ids = ids[0]
        return [int(t) for t in ids]

    async def _generate(
        self, request: Request, req: GenerationRequest, prompt_ids: list[int], fmt: Formatter, adapter_id: str | None
    ) -> Response:
        """Run the request inside its trace span; a streamed response takes the span over and ends it."""
        operation = "chat" if isinstance(req, ChatCompletionRequest) else "text_completion"
        with contextlib.ExitStack() as scope:
            span = scope.enter_context(
                engine_span(request.headers, operation, req.model or self.base_model, adapter_id)
            )
            response = await self._run(request, req, prompt_ids, fmt, adapter_id, span, scope)
            span.set_attribute("http.response.status_code", response.status_code)
            return response

    async def _run(
        self,
        request: Request,
        req: GenerationRequest,
        prompt_ids: list[int],
        fmt: Formatter,
        adapter_id: str | None,
        span: Span,
        scope: contextlib.ExitStack,
    ) -> Response:
        priority = _priority(request)
        try:
            params = req.to_sampling_params(context_left=self.max_model_len - len(prompt_ids))
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        if self.draining:
            raise _unavailable("the engine is draining; retry on another replica", "draining")
        if not self.engine.running:
            raise _unavailable("the engine loop is not running; retry on another replica", "engine_failure")
        wanted = wanted_from_headers(request) if adapter_id is not None else None
        if adapter_id is not None and wanted is not None:  # a catalog adapter: fetched on its first request
            sha256 = await self.fetched.ensure(adapter_id, wanted)
            scope.callback(self.fetched.release, sha256)  # pinned in the disk cache until the request ends
        self.fetched.touch(adapter_id)
        tracker = self.metrics.start_request(priority.name.lower())
        with _engine_errors(adapter_id):
            it = self.engine.generate(fmt.request_id, prompt_ids, params, priority, adapter_id)
        # Only now, the adapter known to be registered, may its id take a metrics label: ids that 404 take none.
        tracker.adapter = self.metrics.adapters.assign(adapter_id)
        streaming = False  # once True, the SSE generator owns `it` and closes it
        try:
            first = await unless_disconnected(request.receive, _next(it, adapter_id))
            if req.stream:
                streaming = True
                events = self._events(it, first, fmt, tracker, req.include_usage, span, scope.pop_all())
                headers = {**_SSE_HEADERS, **self.load_headers()}
                return StreamingResponse(events, media_type="text/event-stream", headers=headers)
            result = await unless_disconnected(request.receive, _collect(it, first, tracker))
        except ClientGone:
            tracker.finish("abort")
            return Response(status_code=499)  # nobody reads it; uvicorn drops it
        finally:
            if not streaming:
                await close_outputs(it)
        tracker.finish()
        text, logprobs, last = result
        record_output(span, last)
        if last.finish_reason == "abort":
            raise _unavailable("the request was aborted: the engine is shutting down", "draining")
        return JSONResponse(fmt.response(text, logprobs, last), headers=self.load_headers())

    async def _events(
        self,
        it: AsyncIterator[RequestOutput],
        first: RequestOutput,
        fmt: Formatter,
        tracker: RequestTracker,
        include_usage: bool,
        span: Span,
        scope: contextlib.ExitStack,
    ) -> AsyncIterator[bytes]:
        """SSE chunks as the engine produces them. Starlette cancels this when the client leaves.

        `scope` holds the request's span: the stream ends it.
        """
        out = first
        try:
            while True:
                tracker.on_output(out)
                chunk = fmt.chunk(out, include_usage)
                if chunk is not None:
                    yield sse(chunk)
                if out.finished:
                    break
                out = await _next(it, None)
            if include_usage:
                yield sse(fmt.usage_chunk(out))
        except ApiError as exc:
            tracker.finish("error")
            record_error(span, exc)
            yield sse(error_body(exc.type, exc.message))
        except Exception as exc:
            logger.exception("stream %s failed", fmt.request_id)
            record_error(span, exc)
            yield sse(error_body("internal_error", "internal server error"))
        finally:
            await close_outputs(it)
            tracker.finish()
            record_output(span, out)
            scope.close()
        yield SSE_DONE

    async def models(self, request: Request) -> Response:
        cards = [model_card(self.base_model, self.created, None, self.max_model_len)]
        cards += [
            model_card(a.adapter_id, self.created, self.base_model, self.max_model_len)
            for a in self.engine.list_adapters()
        ]
        return JSONResponse(list_body(cards))

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        if self.draining:
            raise _unavailable("draining", "draining")
        if not self.engine.running:
            raise _unavailable("the engine loop is not running", "engine_failure")
        return JSONResponse({"status": "ready"})

    async def metrics_text(self, request: Request) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, headers={"Content-Type": content_type})

    def load_headers(self) -> dict[str, str]:
        """The X-Loragate-Load header of an answer starting now."""
        return load_header(self.engine.engine.load_report)

    async def load(self, request: Request) -> Response:
        """GET /load: the engine's load as last published (cheap enough to poll every second: O(adapters on the
        device))."""
        report = self.engine.engine.load_report
        return JSONResponse(
            {
                "running": report.running,
                "waiting": report.waiting,
                "kv_blocks_used": report.kv_blocks_used,
                "kv_blocks_free": report.kv_blocks_free,
                "pool_used": round(report.pool_used, 4),
                "device_adapters": list(report.device_adapters),
                "max_num_seqs": self.max_num_seqs,
            }
        )


def _exception_handlers(api: EngineRoutes) -> dict[Any, Callable[..., Awaitable[Response]]]:
    metrics = api.metrics

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        headers = exc.headers
        if request.url.path in _GENERATION_PATHS:
            metrics.count_error(exc.status)
            headers = {**(headers or {}), **api.load_headers()}
        return error_response(exc.status, exc.type, exc.message, headers)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        type_ = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(exc.status_code, type_, message, exc.headers)

    async def server_error(request: Request, exc: Exception) -> Response:
        # Starlette re-raises the exception after this response is sent; uvicorn logs it.
        headers = None
        if request.url.path in _GENERATION_PATHS:
            metrics.count_error(500)
            headers = api.load_headers()
        return error_response(500, "internal_error", "internal server error", headers)

    return {ApiError: api_error, HTTPException: http_error, Exception: server_error}


def build_app(engine: AsyncEngine, metrics: EngineMetrics | None = None) -> Starlette:
    """The engine's HTTP app; its lifespan starts and stops `engine`."""
    if metrics is None:
        metrics = EngineMetrics(max_adapters=engine.engine.config.metrics_max_adapters)
    metrics.bind_engine(engine.engine)
    fetched = FetchedAdapters.from_config(engine)
    metrics.bind_store(fetched.store)
    api = EngineRoutes(engine, metrics, fetched)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            api.draining = True
            await engine.shutdown()

    routes = [
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        *AdapterRoutes(engine, fetched).routes(),
        Route("/healthz", api.healthz, methods=["GET"]),
        Route("/readyz", api.readyz, methods=["GET"]),
        Route("/metrics", api.metrics_text, methods=["GET"]),
        Route("/load", api.load, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers=_exception_handlers(api), lifespan=lifespan)
    app.state.api = api
    return app
