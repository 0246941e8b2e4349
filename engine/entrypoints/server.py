"""The engine's OpenAI-compatible HTTP API (Starlette); `engine.entrypoints.serving.serve()` runs it under uvicorn.

One request's path: read and validate the JSON body (400 naming the field) -> adapter and priority from
the headers / `model` -> tokenize (a chat through its template, with the tools when the template renders them)
-> sampling parameters (unset fields take the model's generation_config.json defaults), with the grammar of a
`response_format` or a constrained tool call compiled off the event loop (engine/entrypoints/guided.py) -> its `n`
choices as engine requests (engine/entrypoints/choices.py, `AsyncEngine.generate`) -> one JSON response, or
Server-Sent Events that carry each engine step's text as soon as it exists (engine/entrypoints/responses.py). A
client that goes away aborts its request, every choice of it, which frees their KV blocks. Every error is JSON:
{"error": {"type": ..., "message": ...}}.

Adapters: a request names one with `X-Adapter-ID` or `model`; any id that is not registered (hostile
ones included: they can never be registered) is a 404, never the base model. The /v1/adapters admin
routes, which load and unload them at run time, are in engine/entrypoints/adapter_routes.py. A weighted mix of
adapters (loragate_common/adapter_mix.py) is named the same way (`a*0.7+b*0.3`) or in the body's `adapter_mix`
(not both: 400); the request then runs with the mix's derived adapter (engine/lora/mixes.py) under the mix's
canonical name, which its response's `model` and the per-adapter metrics show. A part that is not registered is a
404 `adapter_not_found` naming it, as one adapter is; a malformed mix, or a part that cannot be mixed, a 400.

Load: GET /load and the `X-Loragate-Load` header of every generation answer (errors included) report the
engine's requests running and waiting and its pool use, for the gateway's routing (gateway/admission.py
EngineLoad). Both read the report the engine thread publishes after each step (`LLMEngine.load_report`):
one attribute read, no round trip to the engine thread. GET /load also lists the prompt chunk hashes its prefix
cache holds: those the gateway sent with recent requests in `X-Loragate-Prefix` (loragate_common/prefix.py), a
routing hint that is ignored when malformed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any

from jinja2 import TemplateError
from opentelemetry.trace import Span
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.core.async_engine import AsyncEngine, EngineDeadError, RequestFailed
from engine.core.outputs import LoadReport, RequestOutput
from engine.core.request import SamplingParams
from engine.entrypoints.adapter_routes import AdapterRoutes
from engine.entrypoints.choices import Choices
from engine.entrypoints.fetched_adapters import FetchedAdapters, part_sources_from_headers
from engine.entrypoints.guided import ToolPlan, compile_constraint
from engine.entrypoints.metrics import EngineMetrics, RequestTracker
from engine.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from engine.entrypoints.responses import ChatFormatter, CompletionFormatter, Echo, Formatter, model_card
from engine.entrypoints.tracing import engine_span, record_error, record_output
from engine.lora.peft_config import AdapterError, validate_adapter_id
from engine.structured import template_supports_tools
from loragate_common.adapter_ids import requested_adapter
from loragate_common.adapter_mix import PART_SOURCES_HEADER, is_mix, mix_name, parse_mix
from loragate_common.errors import (
    ApiError,
    adapter_not_found,
    bad_request,
    error_body,
    error_response,
    shown,
    unavailable,
)
from loragate_common.fetched import wanted_from_headers
from loragate_common.http_io import SSE_DONE, ClientGone, list_body, read_json, sse, unless_disconnected
from loragate_common.prefix import HEADER as PREFIX_HEADER
from loragate_common.prefix import PromptChunks
from loragate_common.priority import Priority

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
    except KeyError as exc:
        if adapter_id is None:
            raise
        raise _not_found(adapter_id, exc) from None
    except RequestFailed as exc:  # this request alone: its adapter is broken, or computing it failed
        raise ApiError(500, exc.type, exc.message) from None
    except EngineDeadError as exc:
        raise _unavailable(str(exc), exc.reason) from None


def _not_found(adapter_id: str, exc: KeyError) -> ApiError:
    """404 `adapter_not_found` naming the adapter, or for a mix the part that is not registered (the registry's
    KeyError carries it)."""
    part = exc.args[0] if exc.args else None
    if is_mix(adapter_id) and isinstance(part, str):
        return ApiError(
            404, "adapter_not_found", f"adapter {shown(part)} (a part of the mix {shown(adapter_id)}) is not loaded"
        )
    return adapter_not_found(adapter_id)


def _priority(request: Request) -> Priority:
    try:
        return Priority.parse(request.headers.get("x-priority"))
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def _prefix_chunks(request: Request) -> PromptChunks | None:
    """The gateway's chunk hashes of the prompt (`X-Loragate-Prefix`): only a routing hint, so a malformed or
    repeated header is ignored (None), never an error."""
    values = request.headers.getlist(PREFIX_HEADER)
    return PromptChunks.parse(values[0]) if len(values) == 1 else None


async def _first(choices: Choices, adapter_id: str | None) -> RequestOutput:
    with _engine_errors(adapter_id):
        return await choices.first()


async def _next_choice(choices: Choices) -> tuple[int, RequestOutput] | None:
    with _engine_errors(None):
        return await choices.next()


def _track(tracker: RequestTracker, index: int, out: RequestOutput) -> None:
    """Time the first choice (TTFT, TPOT): every choice of a request shares its prompt and runs beside it."""
    if index == 0:
        tracker.on_output(out)


def _finish(tracker: RequestTracker, lasts: list[RequestOutput]) -> RequestOutput:
    """The request's totals as one output (the prompt once, every choice's tokens), given to the tracker, which
    records the request with them when it finishes."""
    last = lasts[0]
    if len(lasts) > 1:
        last = dataclasses.replace(last, num_output_tokens=sum(out.num_output_tokens for out in lasts))
        tracker.on_output(last)
    return last


async def _collect(choices: Choices, first: RequestOutput, fmt: Formatter, tracker: RequestTracker) -> None:
    index, out = 0, first
    while True:
        _track(tracker, index, out)
        fmt.add(index, out)
        step = await _next_choice(choices)
        if step is None:
            return
        index, out = step


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
        self.sampling_defaults = engine.engine.sampling_defaults  # the model's, read once at start
        self.vocab_size = engine.engine.vocab_size
        self.template_tools = template_supports_tools(self.tokenizer)  # `auto` tool choice works with this model
        self.max_num_seqs = engine.engine.config.max_num_seqs
        self.max_device_adapters = engine.engine.config.max_device_adapters
        self.backends = engine.engine.backends.describe()  # fixed at start
        self.created = int(time.time())
        self.token_text: Callable[[int], str] = functools.lru_cache(maxsize=1 << 16)(self._token_text)

    def _token_text(self, token_id: int) -> str:
        text = self.tokenizer.decode([token_id])
        if not isinstance(text, str):  # never: decode gives a list only for a batch of sequences
            raise TypeError(f"the tokenizer decoded one token to {type(text).__name__}, not str")
        return text

    async def completions(self, request: Request) -> Response:
        req = parse_body(CompletionRequest, await read_json(request))
        adapter_id = self._adapter_id(request, req)
        prompt = req.prompt
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        echo = None
        if req.echo:
            echo = Echo(prompt if isinstance(prompt, str) else self._decode(prompt_ids), list(prompt_ids))
        model = adapter_id or self.base_model
        fmt = CompletionFormatter(model, self.token_text, req.logprobs is not None, req.n, echo)
        return await self._generate(request, req, prompt_ids, fmt, adapter_id, None)

    async def chat_completions(self, request: Request) -> Response:
        req = parse_body(ChatCompletionRequest, await read_json(request))
        adapter_id = self._adapter_id(request, req)
        try:
            tools = req.tool_plan()
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        if tools is not None and not tools.constrained and not self.template_tools:
            raise bad_request(
                'tool_choice: "auto" (the default with tools) needs a chat template that renders tools, and this '
                'model\'s does not; use "required" or a named function (constrained to the tools\' schemas), or "none"'
            )
        prompt_ids = self._chat_prompt(req, tools)
        fmt = ChatFormatter(adapter_id or self.base_model, self.token_text, bool(req.logprobs), req.n, tools)
        return await self._generate(request, req, prompt_ids, fmt, adapter_id, tools)

    def _decode(self, token_ids: list[int]) -> str:
        if any(not 0 <= t < self.vocab_size for t in token_ids):
            raise bad_request(f"prompt: token ids must be in [0, {self.vocab_size})")
        text = self.tokenizer.decode(token_ids)
        if not isinstance(text, str):  # never: decode gives a list only for a batch of sequences
            raise TypeError(f"the tokenizer decoded a prompt to {type(text).__name__}, not str")
        return text

    def _adapter_id(self, request: Request, req: GenerationRequest) -> str | None:
        """X-Adapter-ID wins over `model`; neither, or the base model's name, means the base model. A mix, there or
        in `adapter_mix`, is returned as its canonical name; `adapter_mix` beside an adapter or a mix named in
        X-Adapter-ID or `model` is a 400 (which one would the request mean?).

        An id that could never be registered is answered 404 here, before it reaches the engine.
        """
        header = request.headers.getlist("x-adapter-id")
        name = requested_adapter(header, req.model)
        if req.adapter_mix is not None:
            if name not in ("", self.base_model):
                where = "X-Adapter-ID" if header and header[0].strip() else "model"
                raise bad_request(
                    f"adapter_mix: the request also names {shown(name)} in {where}; name one adapter or mix, in "
                    "one place"
                )
            return mix_name(req.adapter_mix)
        if name in ("", self.base_model):
            return None
        if is_mix(name):
            return mix_name(parse_mix(name, "X-Adapter-ID" if header and header[0].strip() else "model"))
        try:
            return validate_adapter_id(name)
        except AdapterError:
            raise adapter_not_found(name) from None

    def _chat_prompt(self, req: ChatCompletionRequest, tools: ToolPlan | None) -> list[int]:
        """The conversation through the chat template; with tools, and a template that renders them, the
        tools too (they tell the model what it may call, constrained or not)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("messages: the served model has no chat template; use /v1/completions")
        extra: dict[str, Any] = {}
        if tools is not None and self.template_tools:
            extra["tools"] = tools.template_tools()
        try:
            encoded = self.tokenizer.apply_chat_template(
                req.template_messages(), add_generation_prompt=True, tokenize=True, **extra
            )
        except TemplateError as exc:  # the template rejects the conversation (e.g. role order)
            raise bad_request(f"messages: {exc}") from None
        # transformers 5 returns a BatchEncoding; older versions a plain list of ids. int() checks each id.
        ids: list[Any] = list(encoded["input_ids"] if isinstance(encoded, Mapping) else encoded)
        if ids and isinstance(ids[0], list):  # a batch of one conversation
            ids = ids[0]
        return [int(t) for t in ids]

    async def _generate(
        self,
        request: Request,
        req: GenerationRequest,
        prompt_ids: list[int],
        fmt: Formatter,
        adapter_id: str | None,
        tools: ToolPlan | None,
    ) -> Response:
        """Run the request inside its trace span; a streamed response takes the span over and ends it."""
        operation = "chat" if isinstance(req, ChatCompletionRequest) else "text_completion"
        with contextlib.ExitStack() as scope:
            span = scope.enter_context(
                engine_span(request.headers, operation, req.model or self.base_model, adapter_id)
            )
            params = await self._params(req, prompt_ids, tools)
            response = await self._run(request, req, prompt_ids, params, fmt, adapter_id, span, scope)
            span.set_attribute("http.response.status_code", response.status_code)
            return response

    async def _params(self, req: GenerationRequest, prompt_ids: list[int], tools: ToolPlan | None) -> SamplingParams:
        """The request's sampling parameters, its grammar (if any) compiled off the event loop; 400s name the
        field."""
        try:
            params = req.to_sampling_params(self.max_model_len - len(prompt_ids), defaults=self.sampling_defaults)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        constraint = await compile_constraint(self.tokenizer, req.response_format, tools)
        return params if constraint is None else dataclasses.replace(params, constraint=constraint)

    async def _run(
        self,
        request: Request,
        req: GenerationRequest,
        prompt_ids: list[int],
        params: SamplingParams,
        fmt: Formatter,
        adapter_id: str | None,
        span: Span,
        scope: contextlib.ExitStack,
    ) -> Response:
        priority = _priority(request)
        if self.draining:
            raise _unavailable("the engine is draining; retry on another replica", "draining")
        if not self.engine.running:
            raise _unavailable("the engine loop is not running; retry on another replica", "engine_failure")
        await self._fetch(request, adapter_id, scope)
        tracker = self.metrics.start_request(priority.name.lower())
        with _engine_errors(adapter_id):
            choices = Choices(
                self.engine, fmt.request_id, prompt_ids, params, req.n, priority, adapter_id, _prefix_chunks(request)
            )
        # Only now, the adapter known to be registered, may its id take a metrics label: ids that 404 take none.
        tracker.adapter = self.metrics.adapters.assign(adapter_id)
        streaming = False  # once True, the SSE generator owns `choices` and closes them
        try:
            first = await unless_disconnected(request.receive, _first(choices, adapter_id))
            if req.stream:
                streaming = True
                events = self._events(choices, first, fmt, tracker, req.include_usage, span, scope.pop_all())
                headers = {**_SSE_HEADERS, **self.load_headers()}
                return StreamingResponse(events, media_type="text/event-stream", headers=headers)
            await unless_disconnected(request.receive, _collect(choices, first, fmt, tracker))
        except ClientGone:
            tracker.finish("abort")
            return Response(status_code=499)  # nobody reads it; uvicorn drops it
        finally:
            if not streaming:
                await choices.aclose()
        last = _finish(tracker, fmt.lasts)
        tracker.finish()
        record_output(span, last)
        if any(out.finish_reason == "abort" for out in fmt.lasts):
            raise _unavailable("the request was aborted: the engine is shutting down", "draining")
        return JSONResponse(fmt.response(), headers=self.load_headers())

    async def _fetch(self, request: Request, adapter_id: str | None, scope: contextlib.ExitStack) -> None:
        """Fetch and register the request's catalog adapter, or its mix's catalog parts, that this engine has not
        registered yet (the gateway sends their sources); each stays pinned in the disk cache until the request
        ends."""
        if adapter_id is None:
            return
        if not is_mix(adapter_id):
            if request.headers.get(PART_SOURCES_HEADER) is not None:
                raise bad_request(
                    f"{PART_SOURCES_HEADER}: names the sources of a mix's parts; this request names one adapter"
                )
            wanted = wanted_from_headers(request)
            if wanted is not None:  # a catalog adapter: fetched on its first request
                scope.callback(self.fetched.release, await self.fetched.ensure(adapter_id, wanted))
            self.fetched.touch(adapter_id)
            return
        parts = parse_mix(adapter_id)
        sources = part_sources_from_headers(request, parts)
        if sources:
            for sha256 in await self.fetched.ensure_parts(sources):
                scope.callback(self.fetched.release, sha256)
        for part in parts:
            self.fetched.touch(part.ref)

    async def _events(
        self,
        choices: Choices,
        first: RequestOutput,
        fmt: Formatter,
        tracker: RequestTracker,
        include_usage: bool,
        span: Span,
        scope: contextlib.ExitStack,
    ) -> AsyncIterator[bytes]:
        """SSE chunks as the engine produces them, each choice's tagged with its index. Starlette cancels this
        when the client leaves.

        `scope` holds the request's span: the stream ends it.
        """
        last = first
        try:
            if isinstance(fmt, ChatFormatter):
                for start in fmt.start_chunks(include_usage):
                    yield sse(start)
            index, out = 0, first
            while True:
                _track(tracker, index, out)
                chunk = fmt.chunk(index, out, include_usage)
                if chunk is not None:
                    yield sse(chunk)
                step = await _next_choice(choices)
                if step is None:
                    break
                index, out = step
            last = _finish(tracker, fmt.lasts)
            if include_usage:
                yield sse(fmt.usage_chunk())
        except ApiError as exc:
            tracker.finish("error")
            record_error(span, exc)
            yield sse(error_body(exc.type, exc.message))
        except Exception as exc:
            logger.exception("stream %s failed", fmt.request_id)
            record_error(span, exc)
            yield sse(error_body("internal_error", "internal server error"))
        finally:
            await choices.aclose()
            tracker.finish()
            record_output(span, last)
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
        device + held prefixes))."""
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
                "max_device_adapters": self.max_device_adapters,
                "backends": self.backends,
                "sampling_defaults": self.sampling_defaults.values(),
                "prefixes": list(report.prefixes),
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
