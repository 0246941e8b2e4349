"""Forward one admitted request to an engine replica and relay its answer.

- Non-streaming: the upstream's JSON (any status below 500) is passed through unchanged.
- Streaming: Server-Sent Events are relayed one event at a time, as they arrive (never buffered beyond an
  event boundary). The gateway always asks the upstream for the final usage chunk (to settle the
  tenant's token budget with real numbers) and drops it, and the `"usage": null` it puts on every
  chunk, when the client did not ask for it.
- Failures: a connect error, a timeout, a stream that breaks off or a 502/503/504 counts against the
  upstream's circuit breaker; a 500 (the engine answered: the request, often its adapter, failed) and a
  4xx (the client's doing) do not. A 5xx or transport failure before the first byte reached the client
  is retried ONCE on another upstream; after it, the client gets `data: {"error": ...}` then
  `data: [DONE]`, so no token is ever sent twice.
- A catalog adapter being fetched (503 `adapter_loading`) or whose fetch failed (502 `adapter_fetch_failed`),
  as the engine's X-Loragate-Reason says, is the client's answer as the engine gave it (status, body,
  Retry-After, reason): not retried elsewhere (the engine that owns the adapter is fetching it) and not
  held against the engine's breaker (it says nothing about the engine's health).
- A vLLM engine (gateway/vllm.py) gets the priority in the body; a catalog adapter it does not list is first
  loaded by its agent (whose `adapter_loading` / `adapter_fetch_failed` pass through as an engine's), and once
  more if vLLM answers that it has no such model; its error bodies come back in the gateway's shape.
- Upstream headers are the proxy's own: a client's headers never reach an engine, so only the gateway can
  name an adapter's source (X-Adapter-Source, X-Adapter-SHA256, X-Adapter-Size, from the catalog; for a mix
  of adapters, X-Adapter-Part-Sources with one such source per catalog part).
- A mix of adapters (`Call.parts`) goes as one adapter, its canonical name (loragate_common/adapter_mix.py),
  and never to a vLLM engine, which cannot serve one (`Call.unable` holds them all).

The `Exchange` records what happened (status, outcome, tokens, the slot held); the app settles it
(release the slot, reconcile the reservation) once the response has been sent, whatever happened.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
from starlette.responses import Response, StreamingResponse

from gateway import vllm
from gateway.adapter_catalog import Pinned
from gateway.admission import AdmissionController, EngineLoad, Shed, Slot
from gateway.budgets import Hold
from gateway.engine_kinds import EngineKind
from gateway.prefix_index import NO_HINTS, Hints
from gateway.ratelimit import Reservation
from gateway.telemetry import GatewayMetrics, inject_headers
from loragate_common.errors import error_body, error_response
from loragate_common.http_io import SSE_DONE, sse
from loragate_common.prefix import HEADER as PREFIX_HEADER
from loragate_common.prefix import PromptChunks
from loragate_common.priority import Priority

logger = logging.getLogger(__name__)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_USAGE_NULL = b', "usage": null}'  # how a stream chunk's JSON ends when the usage is asked for (and not yet known)


@dataclass(frozen=True, slots=True)
class MixedPart:
    """One part of a mix as the gateway resolved it: `ref` is what the engine serves for it, the ref the gateway
    would send for that part alone (the adapter, the variant its rollout chose, a catalog version `ID@N`)."""

    ref: str
    weight: float
    rollout: str | None = None  # the rollout the client named for this part, when `ref` is one of its variants
    variant: str | None = None  # that variant as the rollout names it (`ref` is its catalog version, if any)
    route: str | None = None  # how the rollout chose it ("split", "override", "rollback", "promoted")
    pinned: Pinned | None = None  # the catalog version `ref` names, if it is a catalog adapter


@dataclass(frozen=True, slots=True, kw_only=True)
class Call:
    """One request as it goes upstream."""

    path: str
    body: dict[str, Any]  # the client's body with `model` set to `adapter` (request_context.upstream_body)
    tenant: str
    adapter: str | None  # the resolved adapter id; None: the base model
    served: str  # what X-Loragate-Adapter and the metrics' adapter label say: the adapter or base model
    priority: Priority
    stream: bool
    include_usage: bool  # the client wants the final usage chunk
    started_at: float  # time.monotonic() when the gateway received it
    rollout: str | None = None  # the rollout name the client asked for, when `adapter` is one of its variants
    variant: str | None = None  # that variant as the rollout names it (`adapter` is its catalog version, if any)
    route: str | None = None  # how the rollout chose it: "split", "override" (the client named it) or "rollback"
    adapter_headers: Mapping[str, str] = field(default_factory=dict)  # a catalog adapter's source headers
    deprecated: bool = False  # a deprecated catalog version: the answer says so (Deprecation: true)
    affinity: str | None = None  # the key admission places it by (the adapter, unless affinity is off)
    request_id: str = ""  # the usage ledger's key for it (gateway/usage.py)
    estimated_prompt_tokens: int = 0  # the gateway's estimate, for a stream cut before the engine's usage
    prefix: PromptChunks | None = None  # its prompt's chunk hashes (prefix routing), sent to the engine
    hints: Hints = NO_HINTS  # where its prefix and session are held (gateway/prefix_index.py)
    unable: frozenset[str] = frozenset()  # upstreams that cannot serve it (Fleet.unable)
    parts: tuple[MixedPart, ...] = ()  # a mix's parts by ref (`adapter` is their mix_name); empty: not a mix


@dataclass(slots=True)
class Exchange:
    """The mutable record of one proxied request (owned by one request's task)."""

    slot: Slot | None = None
    reservation: Reservation | None = None  # the tenant's reserved tokens, settled after the response
    hold: Hold | None = None  # the tokens held against the tenant's budgets, settled after the response
    status: int = 0
    outcome: str = "ok"
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    delivered: bool = False  # some byte of the answer reached the client
    ttft_s: float | None = None  # arrival to the first token sent (a whole answer: to the answer)
    last_token_at: float | None = None  # time.monotonic() of the last token sent
    chunks_sent: int = 0  # content events sent (a stream's tokens, for one cut before its usage came)
    judged: bool = False  # recorded against its rollout variant already
    upstream: httpx.Response | None = None  # an open upstream stream, closed on settle
    tried: set[str] = field(default_factory=set)
    limit_headers: dict[str, str] | None = None  # RateLimit-* of the tenant's admission; None: not admitted yet

    def token_sent(self, started_at: float) -> None:
        """Content reached the client now: the first time, that is the request's time to first token."""
        now = time.monotonic()
        if self.ttft_s is None:
            self.ttft_s = now - started_at
        self.last_token_at = now
        self.chunks_sent += 1

    def used_tokens(self, estimated_prompt: int) -> tuple[int, int] | None:
        """(prompt, completion) tokens this request used: the engine's usage, or for a stream cut before it
        came the events sent and the prompt estimate; None when nothing reached the client."""
        if self.prompt_tokens is not None and self.completion_tokens is not None:
            return self.prompt_tokens, self.completion_tokens
        if not self.delivered:
            return None
        return (self.prompt_tokens if self.prompt_tokens is not None else estimated_prompt), self.chunks_sent

    def take_usage(self, usage: Any) -> None:
        if isinstance(usage, dict):
            self.prompt_tokens = _int_or_none(usage.get("prompt_tokens"))
            self.completion_tokens = _int_or_none(usage.get("completion_tokens"))

    async def close_upstream(self) -> None:
        if self.upstream is not None:
            with anyio.CancelScope(shield=True):
                await self.upstream.aclose()
            self.upstream = None


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# Answers that say the engine itself is unwell (not this one request): they count against its breaker.
BREAKER_STATUSES = frozenset({502, 503, 504})
UPSTREAM_UNAVAILABLE = "upstream_unavailable"  # the X-Loragate-Reason of an engine's 503 passed through
# An engine's answers about one catalog adapter's download: passed through as they are, never retried elsewhere.
ADAPTER_REASONS = frozenset({"adapter_loading", "adapter_fetch_failed"})


class UpstreamFailed(Exception):
    """One attempt failed (retried once elsewhere); `response` is what to answer if it was the last.

    `trips_breaker`: the failure counts against the upstream's breaker: it was unreachable, timed out, broke
    off, or answered 502/503/504. An engine that answers 500 is up and answering; the failure is the
    request's (often its adapter's: a broken canary must not eject the engine that serves everyone else).
    """

    def __init__(self, response: Response, outcome: str, trips_breaker: bool = True) -> None:
        super().__init__(outcome)
        self.response = response
        self.outcome = outcome
        self.trips_breaker = trips_breaker


def _failure(status: int, type_: str, message: str) -> UpstreamFailed:
    return UpstreamFailed(error_response(status, type_, message), type_)


def _passthrough(resp: httpx.Response, content: bytes | None = None) -> Response:
    """An engine's answer as the client gets it (`content`: its body translated, a vLLM error's). An engine's
    503 (draining, its loop down) becomes the gateway's `upstream_unavailable`: the engine's own reason
    describes the engine, not this gateway (its message, in the body, still says what happened)."""
    headers = {k: v for k, v in resp.headers.items() if k.lower() == "retry-after"}
    if resp.status_code == 503:
        headers = {"Retry-After": headers.get("retry-after", "1"), "X-Loragate-Reason": UPSTREAM_UNAVAILABLE}
    if content is not None:
        return Response(content, status_code=resp.status_code, headers=headers, media_type="application/json")
    return Response(
        resp.content,
        status_code=resp.status_code,
        headers=headers,
        media_type=resp.headers.get("content-type", "application/json"),
    )


def _adapter_answer(resp: httpx.Response, reason: str) -> Response:
    """An engine's adapter_loading / adapter_fetch_failed, as it gave it."""
    headers = {"Retry-After": resp.headers.get("retry-after", "1"), "X-Loragate-Reason": reason}
    media_type = resp.headers.get("content-type", "application/json")
    return Response(resp.content, status_code=resp.status_code, headers=headers, media_type=media_type)


class SseReader:
    """Splits an upstream byte stream into whole SSE events (each ending in a blank line)."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks
        self._buffer = b""

    async def next_event(self) -> bytes | None:
        """The next event including its b"\\n\\n"; None at a clean end of stream."""
        while (end := self._buffer.find(b"\n\n")) < 0:
            chunk = await anext(self._chunks, None)
            if chunk is None:
                return None
            self._buffer += chunk.replace(b"\r\n", b"\n")
        event, self._buffer = self._buffer[: end + 2], self._buffer[end + 2 :]
        return event


class Proxy:
    def __init__(self, client: httpx.AsyncClient, admission: AdmissionController, metrics: GatewayMetrics) -> None:
        self.client = client
        self.admission = admission
        self.metrics = metrics

    async def forward(self, call: Call, exchange: Exchange) -> Response:
        """The response for `call`, retried once on another upstream if the first attempt fails."""
        last: UpstreamFailed | None = None
        for attempt in range(2):
            if attempt == 1:
                if not await self._reacquire(call, exchange):
                    break
            try:
                return await self._attempt(call, exchange)
            except UpstreamFailed as failed:
                assert exchange.slot is not None
                breaker = exchange.slot.upstream.breaker
                if failed.trips_breaker:
                    breaker.record_failure()
                else:
                    breaker.record_answered()
                logger.warning("upstream %s failed (%s)", exchange.slot.upstream.url, failed.outcome)
                last = failed
        assert last is not None
        exchange.outcome = last.outcome
        return last.response

    async def _reacquire(self, call: Call, exchange: Exchange) -> bool:
        """Swap the failed upstream's slot for one on another upstream; False if there is none."""
        assert exchange.slot is not None
        exchange.slot.release()
        try:
            exchange.slot = await self.admission.acquire(
                call.priority,
                call.tenant,
                exclude=call.unable | exchange.tried,
                affinity=call.affinity,
                hints=call.hints,
            )
        except Shed:
            exchange.slot = None
            return False
        return True

    async def _attempt(self, call: Call, exchange: Exchange) -> Response:
        assert exchange.slot is not None
        upstream = exchange.slot.upstream
        url = upstream.url
        exchange.tried.add(url)
        body = call.body
        if call.stream:  # always ask for usage: the token budget is settled with it
            body = {**body, "stream_options": {**(body.get("stream_options") or {}), "include_usage": True}}
        headers = {"Content-Type": "application/json", "X-Priority": call.priority.name.lower()}
        if call.adapter is not None:
            headers["X-Adapter-ID"] = call.adapter
            headers.update(call.adapter_headers)
        if call.prefix is not None and call.prefix.hashes:  # the engine reports what of it its cache keeps
            headers[PREFIX_HEADER] = call.prefix.header()
        inject_headers(headers)
        vllm_engine = upstream.kind is EngineKind.VLLM
        if vllm_engine:
            refused = await self._vllm_prepare(call, exchange)
            if refused is not None:
                return refused
            body = vllm.request_body(body, call.priority)
        resp = await self._send(url, call.path, body, headers, exchange)
        if vllm_engine and resp.status_code == 404 and call.adapter_headers:
            # vLLM no longer has the catalog adapter it listed (it restarted): load it again, once
            await exchange.close_upstream()
            upstream.serves = upstream.serves - {call.adapter or ""}
            refused = await self._vllm_prepare(call, exchange)
            if refused is not None:
                return refused
            resp = await self._send(url, call.path, body, headers, exchange)
        load = resp.headers.get("x-loragate-load")
        if load is not None:  # the engine's own count of its requests, every gateway replica's included
            upstream.reported = EngineLoad.parse(load, time.monotonic()) or upstream.reported
        if resp.status_code >= 400 or not call.stream:
            return await self._whole(call, resp, exchange)
        return await self._start_stream(call, resp, exchange)

    async def _send(
        self, url: str, path: str, body: dict[str, Any], headers: dict[str, str], exchange: Exchange
    ) -> httpx.Response:
        request = self.client.build_request("POST", f"{url}{path}", json=body, headers=headers)
        try:
            resp = await self.client.send(request, stream=True)
        except httpx.TimeoutException as exc:
            raise _failure(504, "upstream_timeout", f"upstream {url} timed out: {exc!r}") from None
        except httpx.HTTPError as exc:
            raise _failure(502, "upstream_error", f"upstream {url} failed: {exc!r}") from None
        exchange.upstream = resp
        return resp

    async def _vllm_prepare(self, call: Call, exchange: Exchange) -> Response | None:
        """Before a request goes to a vLLM engine (gateway/vllm.py): a 400 for what it would drop, and a catalog
        adapter it does not list loaded by its agent. None: send it; else the answer to give."""
        assert exchange.slot is not None
        upstream = exchange.slot.upstream
        problem = vllm.unsupported(call.body)
        if problem is not None:
            exchange.status, exchange.outcome = 400, "upstream_client_error"
            return error_response(400, "invalid_request_error", problem)
        if not call.adapter_headers or call.adapter is None or call.adapter in upstream.serves:
            return None
        try:
            answer = await vllm.ensure(self.client, upstream, call.adapter, call.adapter_headers)
        except httpx.HTTPError as exc:
            raise _failure(502, "upstream_error", f"the agent of {upstream.url} failed: {exc!r}") from None
        if answer is None:
            return None
        reason = answer.headers.get("x-loragate-reason", "")
        if answer.status_code == 503 and reason not in ADAPTER_REASONS:  # its vLLM is down: another engine may do
            raise UpstreamFailed(answer, UPSTREAM_UNAVAILABLE)
        upstream.breaker.record_answered()
        exchange.status = answer.status_code
        exchange.outcome = reason if reason in ADAPTER_REASONS else "upstream_client_error"
        return answer

    async def _whole(self, call: Call, resp: httpx.Response, exchange: Exchange) -> Response:
        """A non-streaming answer, or an error status of a streaming one: read it all, pass it through."""
        url = str(resp.request.url)
        try:
            await resp.aread()
        except httpx.TimeoutException as exc:
            raise _failure(504, "upstream_timeout", f"upstream {url} timed out: {exc!r}") from None
        except httpx.HTTPError as exc:
            raise _failure(502, "upstream_error", f"upstream {url} broke off: {exc!r}") from None
        finally:
            await exchange.close_upstream()
        assert exchange.slot is not None
        reason = resp.headers.get("x-loragate-reason", "")
        if resp.status_code >= 400 and exchange.slot.upstream.kind is EngineKind.VLLM:
            content, _ = vllm.error_answer(resp, call.adapter)
            return self._error(resp, exchange, _passthrough(resp, content))
        if resp.status_code >= 500 and reason in ADAPTER_REASONS:
            exchange.slot.upstream.breaker.record_answered()
            exchange.status, exchange.outcome = resp.status_code, reason
            return _adapter_answer(resp, reason)
        if resp.status_code >= 400:
            return self._error(resp, exchange, _passthrough(resp))
        exchange.slot.upstream.breaker.record_success()
        exchange.status = resp.status_code
        exchange.token_sent(call.started_at)
        try:
            exchange.take_usage(resp.json().get("usage"))
        except (ValueError, AttributeError):
            pass
        return _passthrough(resp)

    def _error(self, resp: httpx.Response, exchange: Exchange, answer: Response) -> Response:
        """An engine's error status: a 5xx fails this attempt (retried once elsewhere; 502-504 count against its
        breaker), a 4xx is the client's answer."""
        assert exchange.slot is not None
        if resp.status_code >= 500:
            outcome = UPSTREAM_UNAVAILABLE if resp.status_code == 503 else f"upstream_{resp.status_code}"
            raise UpstreamFailed(answer, outcome, trips_breaker=resp.status_code in BREAKER_STATUSES)
        exchange.slot.upstream.breaker.record_success()
        exchange.status = resp.status_code
        exchange.outcome = "upstream_client_error"
        return answer

    async def _start_stream(self, call: Call, resp: httpx.Response, exchange: Exchange) -> Response:
        """Wait for the first whole event (a failure until then is retryable), then relay the rest."""
        url = str(resp.request.url)
        reader = SseReader(resp.aiter_raw())
        try:
            first = await reader.next_event()
        except httpx.HTTPError as exc:
            await exchange.close_upstream()
            raise _failure(502, "upstream_error", f"upstream {url} broke off: {exc!r}") from None
        if first is None:
            await exchange.close_upstream()
            raise _failure(502, "upstream_error", f"upstream {url} closed the stream before any event")
        exchange.status = 200
        return StreamingResponse(
            self._relay(call, reader, first, exchange), media_type="text/event-stream", headers=_SSE_HEADERS
        )

    async def _relay(self, call: Call, reader: SseReader, first: bytes, exchange: Exchange) -> AsyncIterator[bytes]:
        """Upstream events to the client as they come; a break-off ends the stream with an error event."""
        event: bytes | None = first
        done = False
        try:
            while event is not None:
                out, done = self._event(call, event, exchange)
                if out:
                    exchange.delivered = True
                    yield out
                if done:
                    break
                event = await reader.next_event()
            if not done:
                raise httpx.RemoteProtocolError("the stream ended without [DONE]")
        except httpx.HTTPError as exc:
            assert exchange.slot is not None
            exchange.slot.upstream.breaker.record_failure()
            exchange.outcome = "upstream_error"
            logger.warning("upstream stream broke off: %r", exc)
            yield sse(error_body("upstream_error", f"the upstream stream broke off: {exc}"))
            yield SSE_DONE
            return
        finally:
            await exchange.close_upstream()
        assert exchange.slot is not None
        exchange.slot.upstream.breaker.record_success()
        self._report_timing(call, exchange)

    def _report_timing(self, call: Call, exchange: Exchange) -> None:
        """A finished stream's time to first token, and its mean time per output token after the first."""
        if exchange.ttft_s is None or exchange.last_token_at is None:
            return
        self.metrics.observe_ttft(call.served, exchange.ttft_s)
        n = exchange.completion_tokens
        if n is not None and n > 1:
            first_at = call.started_at + exchange.ttft_s
            self.metrics.observe_tpot(call.served, (exchange.last_token_at - first_at) / (n - 1))

    def _event(self, call: Call, event: bytes, exchange: Exchange) -> tuple[bytes, bool]:
        """What to send the client for one upstream event, and whether it was the last ([DONE])."""
        data = event.removeprefix(b"data:").strip()
        if data == b"[DONE]":
            return SSE_DONE, True
        if data.startswith(b'{"id"') and data.endswith(_USAGE_NULL):
            # A token chunk as the engine writes it (json.dumps' separators, the usage we asked for last): the
            # `"usage": null` comes off without parsing and writing the JSON again, the gateway's main cost per
            # event. Any other shape takes the general path below.
            exchange.token_sent(call.started_at)
            return (event if call.include_usage else b"data: " + data[: -len(_USAGE_NULL)] + b"}\n\n"), False
        try:
            chunk = json.loads(data)
        except ValueError:
            return event, False  # a comment or unknown field: relay as-is
        if not isinstance(chunk, dict):
            return event, False
        if "error" in chunk:
            exchange.outcome = "upstream_error"
        choices = chunk.get("choices")
        if chunk.get("usage") is not None and not choices:  # the final usage chunk
            exchange.take_usage(chunk["usage"])
            return (event if call.include_usage else b""), False
        if choices:
            exchange.token_sent(call.started_at)
        if not call.include_usage and "usage" in chunk:
            del chunk["usage"]
            return sse(chunk), False
        return event, False
