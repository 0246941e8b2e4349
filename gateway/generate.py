"""POST /v1/completions and /v1/chat/completions: one generation request's path through the gateway.

  auth (TenantGate: Bearer key -> tenant, else 401; suspended -> 403) -> body (413 / 400) -> adapter
  (X-Adapter-ID or `model`; a rollout name -> one of its variants, gateway/rollout.py; not allowed -> 403;
  a catalog id `ID[@N]` -> its version `ID@N`, sent with the version's source, gateway/adapter_catalog.py;
  unknown -> 404) -> priority (X-Priority capped to the tenant's max_priority) -> rate limit (429
  rate_limited | tokens_exhausted) -> admission (an upstream by the engines holding the prompt's prefix or the
  session, gateway/prefix_index.py, then adapter affinity, gateway/fleet.py; 503 queue_full | queue_timeout |
  circuit_open | no_upstream | draining) -> proxy (gateway/proxy.py; an answer below 400 records where the
  prompt's prefix now is) -> settle:
  release the slot, reconcile the token reservation and the budget hold with the real usage, record the
  rollout variant's outcome, the usage ledger's record (gateway/usage.py), metrics, span.

A request reads `store.active` once, when it starts, and finishes under that policy whatever reloads
meanwhile. The routes are plain ASGI callables (not request -> response functions) so that one task owns
the request from the first byte read to the last byte sent: the span stays current while the stream runs,
and the settle step runs after the response is done, however it ended.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid

import anyio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway.adapter_catalog import AdapterCatalog, Pinned
from gateway.admission import Shed
from gateway.fleet import Fleet
from gateway.policy import Tenant
from gateway.proxy import ADAPTER_REASONS, Call, Exchange, Proxy
from gateway.reload import ActivePolicy, PolicyStore
from gateway.request_context import GenerationBody, resolve_priority, upstream_body
from gateway.rollout import Routed
from gateway.telemetry import GatewayMetrics, finish_span, request_span
from gateway.tenant_gate import TenantGate
from gateway.usage import UsageLedger, UsageRecord, split_version
from loragate_common.adapter_ids import base_id, requested_adapter
from loragate_common.errors import ApiError, adapter_not_found, shown, unavailable
from loragate_common.http_io import ClientGone, read_json, unless_disconnected

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"

# The X-Loragate-Reason values; the metrics' reason label takes only these.
REASONS = frozenset(
    {
        "rate_limited",
        "tokens_exhausted",
        "budget_exhausted",
        "queue_full",
        "queue_timeout",
        "circuit_open",
        "no_upstream",
        "draining",
        "ratelimit_unavailable",
        "upstream_unavailable",
        "adapter_loading",
        "adapter_fetch_failed",
    }
)


class GenerateRoutes:
    """The two generation routes over one gateway's parts."""

    def __init__(
        self,
        store: PolicyStore,
        gate: TenantGate,
        fleet: Fleet,
        proxy: Proxy,
        metrics: GatewayMetrics,
        ledger: UsageLedger,
        max_body_bytes: int,
        adapters: AdapterCatalog,
    ) -> None:
        self.ledger = ledger
        self.adapters = adapters
        self.store = store
        self.gate = gate
        self.fleet = fleet
        self.proxy = proxy
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions", Generate(self, "/v1/completions", chat=False), methods=["POST"]),
            Route("/v1/chat/completions", Generate(self, CHAT_PATH, chat=True), methods=["POST"]),
        ]

    async def resolve_adapter(
        self, request: Request, body: GenerationBody, tenant: Tenant, active: ActivePolicy
    ) -> tuple[str | None, Routed | None, Pinned | None]:
        """The adapter to serve (None: the base model), the rollout routing that chose it, if any, and its
        catalog version, if it is a catalog adapter (then the adapter is that version's `ID@N`).

        403 not allowed (checked on the id without its version), 404 unknown (a catalog adapter no engine
        lists is not unknown: the engine fetches it); a rollout's override header may answer 400 or 403."""
        name = requested_adapter(request.headers.getlist("x-adapter-id"), body.model)
        models = await self.fleet.catalog.models()
        if not name or name in models.bases:
            return None, None, None
        rollout = active.policy.rollout(name)
        if not tenant.allows(name if rollout is not None else base_id(name)):
            raise ApiError(403, "permission_denied", f"adapter {shown(name)} is not allowed for tenant {tenant.id!r}")
        routed = active.rollouts.route(name, tenant, request.headers.get) if rollout is not None else None
        adapter = routed.adapter if routed is not None else name
        try:
            pinned = self.adapters.resolve(adapter)
            if pinned is not None:
                return pinned.ref, routed, pinned
            if models.all and adapter not in models.adapters:  # nothing learned yet: the upstream decides
                raise adapter_not_found(adapter)
        except ApiError:
            if routed is not None:  # a variant nobody serves is the rollout's failure, not the client's
                self.observe_variant(active, routed.rollout, adapter, error=True, ttft_s=None)
            raise
        return adapter, routed, None

    def fallback_call(self, call: Call, exchange: Exchange, response: Response, active: ActivePolicy) -> Call | None:
        """The same request for its rollout's first (stable) variant, when the split sent it to another
        variant and that variant failed it before any byte reached the client: the engine answered 500 (its
        adapter could not be computed) or its adapter could not be fetched, or is still being fetched. Else
        None. A canary's failures are judged against it (and roll it back) without failing the client's
        request; a variant the client named itself (the override header) answers for itself, and an engine
        that is merely busy (503) says nothing about the variant."""
        if call.rollout is None or call.route != "split" or exchange.delivered or not exchange.tried:
            return None
        if exchange.outcome not in (*ADAPTER_REASONS, "upstream_500"):
            return None
        if isinstance(response, StreamingResponse):
            return None
        rollout = active.policy.rollout(call.rollout)
        if rollout is None or not rollout.variants:
            return None
        stable = rollout.variants[0].adapter
        if stable == call.variant:
            return None
        try:
            pinned = self.adapters.resolve(stable)
        except ApiError:
            return None
        adapter = pinned.ref if pinned is not None else stable
        logger.info(
            "rollout %s: variant %s failed (%d %s); answering from %s",
            call.rollout,
            call.variant,
            response.status_code,
            exchange.outcome,
            stable,
        )
        return dataclasses.replace(
            call,
            body=upstream_body(call.body, adapter),
            adapter=adapter,
            served=adapter,
            variant=stable,
            adapter_headers=pinned.headers() if pinned is not None else {},
            deprecated=pinned is not None and pinned.deprecated,
            affinity=adapter if call.affinity is not None else None,
        )

    async def retarget(self, exchange: Exchange) -> Exchange:
        """A fresh exchange for a second attempt, keeping the first's token reservation and budget hold (the
        request is charged once); the first attempt's upstream and slot are given back."""
        await exchange.close_upstream()
        if exchange.slot is not None:
            exchange.slot.release()
        return Exchange(reservation=exchange.reservation, hold=exchange.hold, limit_headers=exchange.limit_headers)

    def observe_variant(
        self, active: ActivePolicy, rollout: str, adapter: str, error: bool, ttft_s: float | None
    ) -> None:
        """One finished request of a rollout variant: its metrics and its rollback window."""
        self.metrics.observe_variant(rollout, adapter, error, ttft_s)
        active.rollouts.record(rollout, adapter, error, ttft_s)

    async def admit_and_forward(
        self,
        request: Request,
        tenant: Tenant,
        body: GenerationBody,
        call: Call,
        exchange: Exchange,
        active: ActivePolicy,
    ) -> Response:
        if self.fleet.draining:
            raise unavailable("the gateway is draining and takes no new requests", "draining")
        if exchange.limit_headers is None:  # the first attempt (a canary's fallback is charged once)
            exchange.limit_headers, exchange.reservation, exchange.hold = await self.gate.rate_limit(
                tenant, body.reserve_tokens, active
            )
        headers = dict(exchange.limit_headers)
        index = self.fleet.prefix
        chunks = index.chunks(call.body, call.path == CHAT_PATH, call.adapter)
        session = index.session(call.tenant, request.headers, call.body)
        unable = self.fleet.unable(call.adapter, catalog=bool(call.adapter_headers))
        call = dataclasses.replace(call, prefix=chunks, hints=await index.lookup(chunks, session), unable=unable)
        try:
            exchange.slot = await unless_disconnected(
                request.receive,
                self.fleet.admission.acquire(
                    call.priority, call.tenant, exclude=unable, affinity=call.affinity, hints=call.hints
                ),
            )
            index.count(call.hints, exchange.slot.upstream.url, chunks, session)
            response = await unless_disconnected(request.receive, self.proxy.forward(call, exchange))
            if response.status_code < 400 and exchange.slot is not None:  # where its prefix is now computed
                await index.record(exchange.slot.upstream.url, chunks, session, call.hints)
        except Shed as shed:
            exchange.status, exchange.outcome = 503, shed.reason
            return unavailable(shed.message, shed.reason, shed.retry_after_s, headers).response()
        except ClientGone:
            exchange.status, exchange.outcome = 499, "client_gone"
            return Response(status_code=499)  # nobody reads it; uvicorn drops it
        if exchange.status == 0:
            exchange.status = response.status_code
        response.headers.update(headers)
        if response.status_code < 400 or exchange.tried:  # an engine's error names the adapter that failed
            response.headers["X-Loragate-Adapter"] = call.served
        if call.deprecated:
            response.headers["Deprecation"] = "true"
        return response

    async def settle(self, exchange: Exchange, used: tuple[int, int] | None) -> None:
        """After the response: close the upstream, free the slot, charge the tokens per minute and the
        budgets what the request used (`used`: prompt and completion tokens; None: nothing)."""
        with anyio.CancelScope(shield=True):
            await exchange.close_upstream()
            if exchange.slot is not None:
                exchange.slot.release()
            total = sum(used) if used is not None else 0
            hold, exchange.hold = exchange.hold, None  # settle each once
            await self.gate.settle_budget(hold, total)
            reservation, exchange.reservation = exchange.reservation, None
            if reservation is None:
                return
            try:
                await self.gate.limiter.reconcile(reservation, total)
            except Exception:
                logger.exception("reconciling %s's token reservation failed", reservation.tenant)

    def record_usage(
        self,
        tenant: str,
        status: int,
        latency_s: float,
        *,
        call: Call | None = None,
        used: tuple[int, int] | None = None,
        trace_id: str = "",
    ) -> None:
        """A request's one ledger record and its token counters; `call` None: refused before it had one (no
        adapter, no tokens)."""
        prompt, completion = used if used is not None else (0, 0)
        served = call.served if call is not None else ""
        if call is not None:
            self.metrics.count_tokens(tenant, served, prompt, completion)
        adapter, version = split_version(served)
        self.ledger.record(
            UsageRecord(
                request_id=call.request_id if call is not None else uuid.uuid4().hex,
                at=time.time(),
                tenant=tenant,
                adapter=adapter,
                version=version,
                rollout=(call.rollout or "") if call is not None else "",
                prompt_tokens=prompt,
                completion_tokens=completion,
                status=status,
                priority=call.priority.name.lower() if call is not None else "",
                latency_ms=round(latency_s * 1000, 1),
                trace_id=trace_id,
            )
        )


class Generate:
    """POST /v1/completions or /v1/chat/completions, as an ASGI app."""

    def __init__(self, routes: GenerateRoutes, path: str, chat: bool) -> None:
        self.r = routes
        self.path = path
        self.chat = chat
        self.operation = "chat" if chat else "text_completion"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        r = self.r
        request = Request(scope, receive)
        started = time.monotonic()
        tenant_id = "unknown"
        active = r.store.active  # this request's policy, to the end
        try:
            tenant = r.gate.authenticate(request, active)
            tenant_id = tenant.id  # from here on, answers count as this tenant's
            r.gate.refuse_suspended(tenant)
            data = await read_json(request, r.max_body_bytes)
            body = GenerationBody.parse(data, self.chat)
            adapter, routed, pinned = await r.resolve_adapter(request, body, tenant, active)
            priority = resolve_priority(request.headers.get("x-priority"), active.policy, tenant)
        except ApiError as exc:
            exc.headers = {**r.gate.known_headers(tenant_id), **exc.headers}
            await exc.response()(scope, receive, send)
            finished = time.monotonic()
            r.metrics.observe_request(
                tenant_id, "", exc.status, exc.headers.get("X-Loragate-Reason"), finished - started
            )
            if tenant_id != "unknown":  # refused before it had an adapter: a record without tokens
                r.record_usage(tenant_id, exc.status, finished - started)
            return
        served = adapter or r.fleet.base_name(body.model)
        call = Call(
            path=self.path,
            body=upstream_body(data, adapter),
            tenant=tenant.id,
            adapter=adapter,
            served=served,
            priority=priority,
            stream=body.stream,
            include_usage=body.include_usage,
            started_at=started,
            rollout=routed.rollout if routed is not None else None,
            variant=routed.adapter if routed is not None else None,
            route=routed.how if routed is not None else None,
            adapter_headers=pinned.headers() if pinned is not None else {},
            deprecated=pinned is not None and pinned.deprecated,
            affinity=adapter if active.policy.admission.affinity else None,
            request_id=uuid.uuid4().hex,
            estimated_prompt_tokens=body.prompt_tokens,
        )
        with request_span(
            self.operation, served, tenant=tenant.id, adapter=served, priority=priority.name.lower()
        ) as span:
            if routed is not None:
                span.set_attribute("loragate.rollout", routed.rollout)
                span.set_attribute("loragate.rollout.route", routed.how)  # split, override or rollback
            exchange = Exchange()
            try:
                try:
                    response = await r.admit_and_forward(request, tenant, body, call, exchange, active)
                    stable = r.fallback_call(call, exchange, response, active)
                    if stable is not None:  # a canary that failed before answering: the stable variant answers
                        self._judge_variant(active, call, exchange)
                        span.set_attribute("loragate.rollout.fallback", call.served)
                        call, exchange = stable, await r.retarget(exchange)
                        response = await r.admit_and_forward(request, tenant, body, call, exchange, active)
                except ApiError as exc:
                    exchange.status = exc.status
                    exchange.outcome = exc.headers.get("X-Loragate-Reason", exc.type)
                    response = exc.response()
                if not isinstance(response, StreamingResponse):
                    # The outcome is known: judge the variant before the client can send its next request.
                    self._judge_variant(active, call, exchange)
                await response(scope, receive, send)
            finally:
                used = exchange.used_tokens(call.estimated_prompt_tokens)
                await r.settle(exchange, used)
                exchange.status = exchange.status or 500  # 0: an unexpected error, answered 500 by Starlette
                finished = time.monotonic()
                context = span.get_span_context()
                trace_id = format(context.trace_id, "032x") if context.is_valid else ""
                r.record_usage(tenant.id, exchange.status, finished - started, call=call, used=used, trace_id=trace_id)
                finish_span(
                    span,
                    status_code=exchange.status,
                    outcome=exchange.outcome,
                    input_tokens=exchange.prompt_tokens,
                    output_tokens=exchange.completion_tokens,
                )
                reason = exchange.outcome if exchange.outcome in REASONS else None
                r.metrics.observe_request(tenant.id, served, exchange.status, reason, finished - started)
                self._judge_variant(active, call, exchange)  # a stream: now that it has ended

    def _judge_variant(self, active: ActivePolicy, call: Call, exchange: Exchange) -> None:
        """Record a rollout request's outcome against its variant, once, if it reached an upstream (and
        the client did not leave first)."""
        if call.rollout is None or exchange.judged or not exchange.tried or exchange.status == 499:
            return
        exchange.judged = True
        # An engine's 503 (overloaded, draining) says "not now", nothing about the variant.
        error = exchange.status >= 500 and exchange.status != 503 or exchange.outcome == "upstream_error"
        variant = call.variant if call.variant is not None else call.served
        self.r.observe_variant(active, call.rollout, variant, error, exchange.ttft_s)
