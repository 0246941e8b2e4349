"""OpenTelemetry traces of the engine: one SERVER span per generation request, continuing the caller's trace.

The caller (the gateway) sends its span's context as a W3C `traceparent` header; `engine_span` makes the
engine's span its child, so one request reads as one trace across both services. Attributes follow the
OpenTelemetry GenAI semantic conventions (`gen_ai.*`).

The process's TracerProvider comes from loragate_common/tracing.py (the OTEL_* environment, shared with the
gateway). Until one is set, every span is a no-op, so the engine runs (and its tests pass) without any
tracing backend.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from engine.core.outputs import RequestOutput
from loragate_common.errors import ApiError

_propagator = TraceContextTextMapPropagator()
_tracer = trace.get_tracer("loragate.engine")  # a proxy: follows whatever provider is set later


@contextmanager
def engine_span(headers: Mapping[str, str], operation: str, model: str, adapter: str | None) -> Iterator[Span]:
    """A SERVER span "{operation} {model}", the child of the `traceparent` in `headers` (a new trace
    without one). It is not made the current span: a streamed response ends it from another task.

    An exception is recorded and re-raised; only a server-side failure (not an `ApiError` < 500, which
    is the client's) marks the span as an error.
    """
    carrier = {key.lower(): value for key, value in headers.items()}
    parent = _propagator.extract(carrier)
    attributes = {"gen_ai.operation.name": operation, "gen_ai.request.model": model}
    if adapter is not None:
        attributes["loragate.adapter"] = adapter
    span = _tracer.start_span(f"{operation} {model}", context=parent, kind=SpanKind.SERVER, attributes=attributes)
    try:
        yield span
    except Exception as exc:
        record_error(span, exc)
        raise
    finally:
        span.end()


def record_error(span: Span, exc: Exception) -> None:
    """Record `exc` on `span`; also used for an error met mid-stream (answered as an SSE event)."""
    span.record_exception(exc)
    if isinstance(exc, ApiError):
        span.set_attribute("http.response.status_code", exc.status)
        span.set_attribute("error.type", exc.type)
        if exc.status >= 500:
            span.set_status(StatusCode.ERROR, exc.message)
        return
    span.set_attribute("error.type", type(exc).__qualname__)
    span.set_status(StatusCode.ERROR, str(exc))


def record_output(span: Span, last: RequestOutput) -> None:
    """Token usage and finish reason from a request's last output."""
    span.set_attribute("gen_ai.usage.input_tokens", last.num_prompt_tokens)
    span.set_attribute("gen_ai.usage.output_tokens", last.num_output_tokens)
    span.set_attribute("gen_ai.response.id", last.request_id)
    if last.finish_reason is not None:
        span.set_attribute("gen_ai.response.finish_reasons", [last.finish_reason])
