"""Traces and gateway metrics.

One request through the gateway to a real engine (tiny-random served by uvicorn on 127.0.0.1) must read as
one trace: the engine's SERVER span under the gateway's.

An SDK TracerProvider with an in-memory exporter is installed globally before anything calls
`setup_tracing`, which must then leave it alone. The engine app runs in process on tiny-random; its spans
are checked against the `traceparent` the test sent (parsed here by hand, not by OpenTelemetry) and against
the usage the response itself reports. The env-driven setup (OTLP, console, none) runs in subprocesses,
since a process gets one global provider; the OTLP one exports to a real HTTP receiver here, decoded with
the OTLP protobuf schema. Gateway metrics are read back with prometheus-client's own text parser.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig
from engine.core.async_engine import AsyncEngine
from engine.core.llm_engine import LLMEngine
from engine.entrypoints.server import build_app
from gateway.app import build_app as build_gateway_app
from gateway.auth import hash_key
from gateway.policy import parse_policy
from gateway.ratelimit import MemoryRateLimiter
from gateway.telemetry import GatewayMetrics, finish_span, inject_headers, request_span
from loragate_common.tracing import setup_tracing

from mock_upstream import MockUpstream
from processes import serve_in_thread

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-random"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
T = TypeVar("T")


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # another module may have installed one already
        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: "loragate-tests"}))
        trace.set_tracer_provider(provider)
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    yield memory
    memory.shutdown()


@pytest.fixture
def spans(exporter: InMemorySpanExporter) -> InMemorySpanExporter:
    exporter.clear()
    return exporter


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLMEngine:
    """One engine for the module; each test wraps it in a fresh AsyncEngine (its thread and event loop)."""
    return LLMEngine(EngineConfig(dtype="float32", model=MODEL, max_model_len=256))


def _parse_traceparent(value: str) -> tuple[int, int]:
    version, trace_id, span_id, flags = value.split("-")
    assert (version, len(trace_id), len(span_id)) == ("00", 32, 16)
    assert int(flags, 16) & 1  # sampled (bit 2 may flag a random trace id, W3C level 2)
    return int(trace_id, 16), int(span_id, 16)


def _server_spans(exporter: InMemorySpanExporter, prefix: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER and s.name.startswith(prefix)]


def _on_engine(llm: LLMEngine, scenario: Callable[[httpx.AsyncClient], Awaitable[T]]) -> T:
    """Run `scenario` against the engine app in process (httpx's ASGI transport, no lifespan)."""
    engine = AsyncEngine(llm)
    app = build_app(engine)

    async def run() -> T:
        await engine.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=60) as http:
                return await scenario(http)
        finally:
            await engine.shutdown()

    return asyncio.run(run())


def _sse_events(body: str) -> list[dict[str, Any]]:
    lines = [line.removeprefix("data: ") for line in body.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ---- setup_tracing ----------------------------------------------------------------------------------


def test_setup_tracing_keeps_an_installed_sdk_provider(
    exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    installed = trace.get_tracer_provider()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    with caplog.at_level(logging.DEBUG):
        setup_tracing("loragate-gateway")
        setup_tracing("loragate-engine")
    assert trace.get_tracer_provider() is installed
    assert not [r for r in caplog.records if r.name.startswith(("opentelemetry", "loragate_common.tracing"))]


_SETUP_SCRIPT = """
import sys
from opentelemetry import trace
from loragate_common.tracing import setup_tracing
setup_tracing("svc-from-argument")
setup_tracing("svc-second-call")
provider = trace.get_tracer_provider()
with trace.get_tracer("probe").start_as_current_span("probe-span") as span:
    recording = span.is_recording()
if hasattr(provider, "shutdown"):
    provider.shutdown()
sys.stderr.write(f"RESULT {type(provider).__name__} {recording}\\n")
"""


def _run_setup(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return subprocess.run(
        [sys.executable, "-c", _SETUP_SCRIPT],
        cwd=REPO,
        text=True,
        capture_output=True,
        env={**clean, "PYTHONPATH": str(REPO), **env},
        timeout=120,
    )


def test_setup_tracing_defaults_to_no_provider() -> None:
    proc = _run_setup({})
    assert proc.returncode == 0, proc.stderr
    assert "RESULT ProxyTracerProvider False" in proc.stderr
    assert proc.stdout == ""


def test_setup_tracing_console_exporter() -> None:
    proc = _run_setup({"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "svc-from-env"})
    assert proc.returncode == 0, proc.stderr
    assert "RESULT TracerProvider True" in proc.stderr
    span = json.loads(proc.stdout)  # exactly one span: the second setup_tracing added no exporter
    assert span["name"] == "probe-span"
    assert span["resource"]["attributes"]["service.name"] == "svc-from-env"


def test_setup_tracing_rejects_an_unknown_exporter() -> None:
    proc = _run_setup({"OTEL_TRACES_EXPORTER": "zipkin"})
    assert proc.returncode != 0
    assert "OTEL_TRACES_EXPORTER: unknown exporter 'zipkin'" in proc.stderr


class _OtlpReceiver(BaseHTTPRequestHandler):
    received: list[tuple[str, dict[str, str], bytes]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_setup_tracing_exports_otlp_over_http() -> None:
    _OtlpReceiver.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OtlpReceiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        proc = _run_setup(
            {
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
                "OTEL_EXPORTER_OTLP_HEADERS": "x-tenant-probe=yes",
            }
        )
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 0, proc.stderr
    assert "RESULT TracerProvider True" in proc.stderr
    assert len(_OtlpReceiver.received) == 1
    path, headers, body = _OtlpReceiver.received[0]
    assert (path, headers["x-tenant-probe"]) == ("/v1/traces", "yes")
    export = ExportTraceServiceRequest.FromString(body)
    [resource_spans] = export.resource_spans
    resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert resource["service.name"] == "svc-from-argument"
    names = [s.name for scope in resource_spans.scope_spans for s in scope.spans]
    assert names == ["probe-span"]


# ---- the engine's spans -----------------------------------------------------------------------------


def test_engine_span_continues_the_callers_trace(llm: LLMEngine, spans: InMemorySpanExporter) -> None:
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 7, "temperature": 0, "ignore_eos": True}

    async def scenario(http: httpx.AsyncClient) -> httpx.Response:
        return await http.post("/v1/completions", json=body, headers={"traceparent": TRACEPARENT})

    resp = _on_engine(llm, scenario)
    assert resp.status_code == 200, resp.text
    [span] = _server_spans(spans, "text_completion")
    assert span.name == f"text_completion {MODEL}"
    assert span.context.trace_id == int(TRACE_ID, 16)
    assert span.parent is not None and span.parent.span_id == int(PARENT_ID, 16)
    assert span.parent.is_remote
    usage = resp.json()["usage"]
    attrs = dict(span.attributes or {})
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.request.model"] == MODEL
    assert attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 7
    assert attrs["gen_ai.response.id"] == resp.json()["id"]
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    assert attrs["http.response.status_code"] == 200
    assert "loragate.adapter" not in attrs  # the base model
    assert span.status.status_code is StatusCode.UNSET


def test_engine_span_of_a_stream_ends_with_the_stream(llm: LLMEngine, spans: InMemorySpanExporter) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def scenario(http: httpx.AsyncClient) -> httpx.Response:
        return await http.post("/v1/chat/completions", json=body, headers={"traceparent": TRACEPARENT})

    resp = _on_engine(llm, scenario)
    assert resp.status_code == 200, resp.text
    usage = _sse_events(resp.text)[-1]["usage"]
    [span] = _server_spans(spans, "chat")
    assert span.name == f"chat {MODEL}"
    assert span.context.trace_id == int(TRACE_ID, 16)
    assert span.parent is not None and span.parent.span_id == int(PARENT_ID, 16)
    attrs = dict(span.attributes or {})
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 5


def test_engine_span_without_traceparent_starts_a_trace(llm: LLMEngine, spans: InMemorySpanExporter) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}

    async def scenario(http: httpx.AsyncClient) -> list[httpx.Response]:
        return [await http.post("/v1/completions", json=body) for _ in range(2)]

    responses = _on_engine(llm, scenario)
    assert [r.status_code for r in responses] == [200, 200]
    found = _server_spans(spans, "text_completion")
    assert len(found) == 2
    assert all(s.parent is None for s in found)
    assert found[0].context.trace_id != found[1].context.trace_id


def test_engine_span_of_a_refused_request(llm: LLMEngine, spans: InMemorySpanExporter) -> None:
    """A 400 is the client's error: recorded on the span, which is not marked as failed."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 10_000}

    async def scenario(http: httpx.AsyncClient) -> httpx.Response:
        return await http.post("/v1/completions", json=body, headers={"traceparent": TRACEPARENT})

    resp = _on_engine(llm, scenario)
    assert resp.status_code == 400, resp.text
    [span] = _server_spans(spans, "text_completion")
    assert span.context.trace_id == int(TRACE_ID, 16)
    attrs = dict(span.attributes or {})
    assert attrs["http.response.status_code"] == 400
    assert attrs["error.type"] == "invalid_request_error"
    assert [e.name for e in span.events] == ["exception"]
    assert span.status.status_code is StatusCode.UNSET


# ---- the gateway's spans ----------------------------------------------------------------------------


def test_gateway_span_and_injected_traceparent(spans: InMemorySpanExporter) -> None:
    headers: dict[str, str] = {}
    with request_span("chat", "tiny-random", tenant="acme", adapter="qv-r8", priority="critical") as span:
        inject_headers(headers)
        finish_span(span, status_code=200, outcome="ok", input_tokens=11, output_tokens=3)
    trace_id, parent_id = _parse_traceparent(headers["traceparent"])
    assert trace_id == span.get_span_context().trace_id
    assert parent_id == span.get_span_context().span_id
    [done] = spans.get_finished_spans()
    assert (done.name, done.kind) == ("chat tiny-random", SpanKind.SERVER)
    assert dict(done.attributes or {}) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "tiny-random",
        "loragate.tenant": "acme",
        "loragate.adapter": "qv-r8",
        "loragate_common.priority": "critical",
        "http.response.status_code": 200,
        "loragate.outcome": "ok",
        "gen_ai.usage.input_tokens": 11,
        "gen_ai.usage.output_tokens": 3,
    }
    assert done.status.status_code is StatusCode.UNSET


def test_gateway_span_names_the_rollout_and_how_it_routed(spans: InMemorySpanExporter) -> None:
    policy = parse_policy(f"""version: 1
tenants:
  - {{id: acme, api_keys: ['{hash_key("sk-acme")}'], adapters: ["*"]}}
rollouts:
  - {{name: support, variants: [{{adapter: a1, weight: 1}}, {{adapter: a2, weight: 1}}], override_header: X-Variant}}
""")
    auth = {"Authorization": "Bearer sk-acme", "X-Adapter-ID": "support"}

    async def scenario(url: str) -> None:
        app = build_gateway_app(policy, [url], MemoryRateLimiter())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
            for headers in ({**auth, "X-User-ID": "u1"}, {**auth, "X-Variant": "a2"}):
                resp = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=headers)
                assert resp.status_code == 200

    with MockUpstream() as mock:
        asyncio.run(scenario(mock.url))
    split, forced = [dict(s.attributes or {}) for s in _server_spans(spans, "text_completion")]
    assert (split["loragate.rollout"], split["loragate.rollout.route"]) == ("support", "split")
    assert split["loragate.adapter"] == mock.received[0].headers["x-adapter-id"]
    assert (forced["loragate.rollout"], forced["loragate.rollout.route"], forced["loragate.adapter"]) == (
        "support",
        "override",
        "a2",
    )


def test_inject_headers_outside_a_span_adds_nothing() -> None:
    headers = {"x-adapter-id": "a"}
    inject_headers(headers)
    assert headers == {"x-adapter-id": "a"}


def test_gateway_span_statuses(spans: InMemorySpanExporter) -> None:
    with request_span("text_completion", "m", tenant="t", adapter="m", priority="sheddable") as span:
        finish_span(span, status_code=429, outcome="rate_limited")
    with request_span("text_completion", "m", tenant="t", adapter="m", priority="standard") as span:
        finish_span(span, status_code=503, outcome="queue_full")
    with pytest.raises(RuntimeError, match="boom"):
        with request_span("chat", "m", tenant="t", adapter="m", priority="standard"):
            raise RuntimeError("boom")
    limited, shed, failed = spans.get_finished_spans()
    assert limited.status.status_code is StatusCode.UNSET
    assert "gen_ai.usage.input_tokens" not in (limited.attributes or {})
    assert shed.status.status_code is StatusCode.ERROR
    assert (shed.attributes or {})["loragate.outcome"] == "queue_full"
    assert failed.status.status_code is StatusCode.ERROR
    assert [e.name for e in failed.events] == ["exception"]


# ---- gateway metrics --------------------------------------------------------------------------------


def _samples(metrics: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def test_gateway_metrics_render_every_family() -> None:
    metrics = GatewayMetrics()
    GatewayMetrics()  # a second one in the same process: its own registry, no clash
    metrics.observe_request("acme", "qv-r8", 200, None, 0.4)
    metrics.observe_request("acme", "qv-r8", 429, "rate_limited", 0.001)
    metrics.observe_ttft("qv-r8", 0.2)
    metrics.observe_tpot("qv-r8", 0.03)
    metrics.count_ratelimit("allowed")
    metrics.count_ratelimit("tokens_exhausted")
    metrics.count_ratelimit("tokens_exhausted")
    samples = _samples(metrics)
    assert (
        samples[
            (
                "loragate_gateway_requests_total",
                (("adapter", "qv-r8"), ("reason", ""), ("status", "200"), ("tenant", "acme")),
            )
        ]
        == 1
    )
    assert (
        samples[
            (
                "loragate_gateway_requests_total",
                (("adapter", "qv-r8"), ("reason", "rate_limited"), ("status", "429"), ("tenant", "acme")),
            )
        ]
        == 1
    )
    assert (
        samples[("loragate_gateway_request_duration_seconds_count", (("adapter", "qv-r8"), ("status_class", "2xx")))]
        == 1
    )
    assert samples[
        ("loragate_gateway_request_duration_seconds_sum", (("adapter", "qv-r8"), ("status_class", "2xx")))
    ] == pytest.approx(0.4)
    assert samples[("loragate_gateway_time_to_first_token_seconds_bucket", (("adapter", "qv-r8"), ("le", "0.25")))] == 1
    assert samples[("loragate_gateway_time_to_first_token_seconds_bucket", (("adapter", "qv-r8"), ("le", "0.1")))] == 0
    assert samples[("loragate_gateway_time_per_output_token_seconds_count", (("adapter", "qv-r8"),))] == 1
    decisions = {
        d: samples[("loragate_gateway_ratelimit_decisions_total", (("decision", d),))]
        for d in ("allowed", "rate_limited", "tokens_exhausted", "unavailable")
    }
    assert decisions == {"allowed": 1, "rate_limited": 0, "tokens_exhausted": 2, "unavailable": 0}
    assert not any(
        name.startswith(("loragate_gateway_queue", "loragate_gateway_inflight")) for name, _ in samples
    )  # nothing bound yet


def test_gateway_metrics_read_bound_state_at_scrape_time() -> None:
    metrics = GatewayMetrics()
    queues = {"critical": 0, "standard": 3, "sheddable": 7}
    inflight = {"http://e1:8000": 2, "http://e2:8000": 0}
    breakers = {"http://e1:8000": "closed", "http://e2:8000": "open"}
    redis_errors = [4]
    metrics.bind(
        queue_depths=lambda: dict(queues),
        inflight=lambda: dict(inflight),
        breaker_states=lambda: dict(breakers),
        redis_errors=lambda: redis_errors[0],
    )
    first = _samples(metrics)
    assert first[("loragate_gateway_queue_depth", (("band", "sheddable"),))] == 7
    assert first[("loragate_gateway_inflight", (("upstream", "http://e1:8000"),))] == 2
    assert first[("loragate_gateway_breaker_state", (("state", "open"), ("upstream", "http://e2:8000")))] == 2
    assert first[("loragate_gateway_redis_errors_total", ())] == 4
    queues["sheddable"] = 1
    breakers["http://e2:8000"] = "half_open"
    redis_errors[0] = 9
    second = _samples(metrics)
    assert second[("loragate_gateway_queue_depth", (("band", "sheddable"),))] == 1
    assert second[("loragate_gateway_breaker_state", (("state", "half_open"), ("upstream", "http://e2:8000")))] == 1
    assert ("loragate_gateway_breaker_state", (("state", "open"), ("upstream", "http://e2:8000"))) not in second
    assert second[("loragate_gateway_breaker_state", (("state", "closed"), ("upstream", "http://e1:8000")))] == 0
    assert second[("loragate_gateway_redis_errors_total", ())] == 9


# ---- gateway -> engine: one trace ---------------------------------------------------------------------


def _ancestors(span: ReadableSpan, by_id: dict[int, ReadableSpan]) -> list[int]:
    """Span ids above `span`, nearest first, as far as the collected spans reach."""
    chain: list[int] = []
    parent = span.parent
    while parent is not None:
        chain.append(parent.span_id)
        above = by_id.get(parent.span_id)
        parent = above.parent if above is not None else None
    return chain


def test_gateway_and_engine_spans_share_one_trace(llm: LLMEngine, spans: InMemorySpanExporter) -> None:
    policy = parse_policy(f"version: 1\ntenants:\n  - id: acme\n    api_keys: ['{hash_key('sk-acme')}']\n")
    body = {
        "model": MODEL,
        "prompt": "The quick brown fox",
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }

    async def through_gateway(engine_url: str) -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as upstream_client:
            app = build_gateway_app(policy, [engine_url], MemoryRateLimiter(), client=upstream_client)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=60) as http:
                return await http.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-acme"})

    # Under uvicorn in a thread the app's lifespan runs, and with it the engine loop.
    with serve_in_thread(build_app(AsyncEngine(llm)), lifespan="on") as engine_url:
        resp = asyncio.run(through_gateway(engine_url))
    assert resp.status_code == 200, resp.text
    finished = spans.get_finished_spans()
    [gateway] = [s for s in finished if s.instrumentation_scope.name == "loragate.gateway"]
    [engine] = [s for s in finished if s.instrumentation_scope.name == "loragate.engine"]
    assert gateway.kind is SpanKind.SERVER and engine.kind is SpanKind.SERVER
    assert gateway.name == engine.name == f"text_completion {MODEL}"
    assert gateway.parent is None  # the client sent no traceparent
    assert engine.context.trace_id == gateway.context.trace_id
    assert gateway.context.span_id in _ancestors(engine, {s.context.span_id: s for s in finished})
    gateway_attrs, engine_attrs = dict(gateway.attributes or {}), dict(engine.attributes or {})
    assert gateway_attrs["loragate.tenant"] == "acme"
    assert gateway_attrs["http.response.status_code"] == engine_attrs["http.response.status_code"] == 200
    assert engine_attrs["gen_ai.usage.output_tokens"] == 4
    for key in ("gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens"):
        assert gateway_attrs[key] == engine_attrs[key]
    # The engine's span ends inside the gateway's: the gateway span covers the whole proxied stream.
    assert gateway.start_time <= engine.start_time and engine.end_time <= gateway.end_time
