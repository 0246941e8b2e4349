"""OpenTelemetry traces of the engine: one SERVER span per generation request, continuing the caller's trace.

The caller (the gateway) sends its span's context as a W3C `traceparent` header; `engine_span` makes the
engine's span its child, so one request reads as one trace across both services. Attributes follow the
OpenTelemetry GenAI semantic conventions (`gen_ai.*`).

`setup_tracing` builds the process's TracerProvider from the standard OTEL_* environment. Until one is
set, every span is a no-op, so the engine runs (and its tests pass) without any tracing backend. The
gateway re-exports it from here: it depends on the engine package, never the other way round.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.trace import Span, SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from engine.outputs import RequestOutput
from engine.responses import ApiError

logger = logging.getLogger(__name__)

_EXPORTERS = ("otlp", "console", "none")
_propagator = TraceContextTextMapPropagator()
_tracer = trace.get_tracer("loragate.engine")  # a proxy: follows whatever provider is set later


def setup_tracing(service_name: str) -> None:
    """Install a TracerProvider built from the environment, unless an SDK one is already installed.

    OTEL_TRACES_EXPORTER (comma-separated): `otlp` (OTLP over HTTP; endpoint, headers and timeout from
    the OTEL_EXPORTER_OTLP_* variables), `console` (stdout) or `none` (the default: no provider, spans
    are no-ops). OTEL_SDK_DISABLED=true also means none. The resource's service.name is OTEL_SERVICE_NAME
    if set, else `service_name`. Idempotent: a second call, or a provider set by a test, is left alone.
    """
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        return
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return
    names = [n.strip().lower() for n in os.environ.get("OTEL_TRACES_EXPORTER", "none").split(",")]
    unknown = [n for n in names if n not in _EXPORTERS]
    if unknown:
        raise ValueError(f"OTEL_TRACES_EXPORTER: unknown exporter {unknown[0]!r}; "
                         f"use {', '.join(_EXPORTERS)}")
    if set(names) <= {"none"}:
        return
    name = os.environ.get("OTEL_SERVICE_NAME", "").strip() or service_name
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    if "otlp" in names:
        # Imported here: only a process that exports over OTLP pays for the protobuf stack.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if "console" in names:
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)
    logger.info("tracing: service %s exporting to %s", name, ", ".join(names))


@contextmanager
def engine_span(headers: Mapping[str, str], operation: str, model: str,
                adapter: str | None) -> Iterator[Span]:
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
    span = _tracer.start_span(f"{operation} {model}", context=parent, kind=SpanKind.SERVER,
                              attributes=attributes)
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
