"""The process's OpenTelemetry TracerProvider, built from the standard OTEL_* environment.

Engine and gateway both call `setup_tracing` at start; their spans (engine/entrypoints/tracing.py,
gateway/telemetry.py) share one trace through the W3C `traceparent` the gateway sends. Torch-free.
"""

from __future__ import annotations

import logging
import os

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

logger = logging.getLogger(__name__)

_EXPORTERS = ("otlp", "console", "none")


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
        raise ValueError(f"OTEL_TRACES_EXPORTER: unknown exporter {unknown[0]!r}; use {', '.join(_EXPORTERS)}")
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
