"""POST /v1/completions and /v1/chat/completions: one generation request's path through the gateway.

  auth (TenantGate: Bearer key -> tenant, else 401; suspended -> 403) -> body (413 / 400) -> adapter
  (X-Adapter-ID or `model`; a rollout name -> one of its variants, gateway/rollout.py; not allowed -> 403;
  a catalog id `ID[@N]` -> its version `ID@N`, sent with the version's source, gateway/adapter_catalog.py;
  unknown -> 404; a mix of adapters, `X-Adapter-ID: a*0.7+b*0.3` or `model` or the body's `adapter_mix`, has each
  part resolved so, and goes as one adapter, its canonical name: `resolve_mix`) -> priority (X-Priority capped
  to the tenant's max_priority) -> rate limit (429 rate_limited | tokens_exhausted) -> admission (an upstream
  by the engines holding the prompt's prefix or the session, gateway/prefix_index.py, then adapter affinity,
  gateway/fleet.py; 503 queue_full | queue_timeout | circuit_open | no_upstream | draining) -> proxy
  (gateway/proxy.py; an answer below 400 records where the prompt's prefix now is) -> settle: release the slot,
  reconcile the token reservation and the budget hold with the real usage, record the rollout variant's
  outcome, the usage ledger's record (gateway/usage.py), metrics, span.

A mix (loragate_common/adapter_mix.py) is checked whole before any part is routed: malformed -> 400, a part the
tenant may not use -> 403 naming it, an unknown part -> 404 `adapter_not_found` naming it, as for one adapter.
The engine gets `X-Adapter-ID: mix_name(the parts as resolved)` (also its affinity and prefix key) and, for the
catalog parts, their versions' sources in one `X-Adapter-Part-Sources` header; only loragate engines serve it.
Usage, metrics and spans name the mix and its parts; each part a rollout chose is judged as that variant.

A request reads `store.active` once, when it starts, and finishes under that policy whatever reloads
meanwhile. The routes are plain ASGI callables (not request -> response functions) so that one task owns
the request from the first byte read to the last byte sent: the span stays current while the stream runs,
and the settle step runs after the response is done, however it ended.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway.adapter_catalog import AdapterCatalog, Pinned
from gateway.admission import Shed
from gateway.fleet import Fleet
from gateway.policy import Tenant
from gateway.proxy import ADAPTER_REASONS, Call, Exchange, MixedPart, Proxy
from gateway.reload import ActivePolicy, PolicyStore
from gateway.request_context import GenerationBody, resolve_priority, upstream_body
from gateway.rollout import Routed
from gateway.telemetry import GatewayMetrics, finish_span, request_span
from gateway.tenant_gate import TenantGate
from gateway.upstream import Models
from gateway.usage import UsageLedger, UsageRecord, split_version
from loragate_common.adapter_ids import base_id, requested_adapter
from loragate_common.adapter_mix import BODY_FIELD as MIX_FIELD
from loragate_common.adapter_mix import PART_SOURCES_HEADER, MixPart, is_mix, mix_name, parse_mix
from loragate_common.errors import ApiError, adapter_not_found, bad_request, shown, unavailable
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
        check_allowed(name, tenant, active)
        routed = self.route(request, name, tenant, active)
        adapter = routed.adapter if routed is not None else name
        pinned = self.pin(adapter, routed, active, models, mixed=False)
        return (pinned.ref if pinned is not None else adapter), routed, pinned

    async def resolve_mix(
        self, request: Request, body: GenerationBody, tenant: Tenant, active: ActivePolicy
    ) -> tuple[MixedPart, ...]:
        """The parts of the mix a request names (X-Adapter-ID, else `model`, or the body's `adapter_mix`), by
        ref, each resolved as one adapter named alone would be; () when it names no mix.

        400: a malformed mix (loragate_common/adapter_mix.py's errors), `adapter_mix` with a header or `model`
        naming another adapter or mix, a part naming the base model, two parts served by one adapter; 403: a
        part the tenant may not use (every part is checked before any is routed); 404 `adapter_not_found`: an
        unknown part, named."""
        header = request.headers.getlist("x-adapter-id")
        name = requested_adapter(header, body.model)
        field = "X-Adapter-ID" if header and header[0].strip() else "model"
        named = parse_mix(name, field) if is_mix(name) else None
        asked = body.adapter_mix if body.adapter_mix is not None else named
        if asked is None:
            return ()
        models = await self.fleet.catalog.models()
        if body.adapter_mix is not None:
            if named is not None or name and (field == "X-Adapter-ID" or models.all and name not in models.bases):
                raise bad_request(
                    f"{MIX_FIELD}: the request also names {shown(name)} in {field}; name one adapter or mix"
                )
            field = MIX_FIELD
        for part in asked:
            if part.ref in models.bases:
                raise bad_request(f"{field}: the base model {shown(part.ref)} cannot be a part of a mix")
            check_allowed(part.ref, tenant, active)
        parts = [self.resolve_part(request, part, tenant, active, models) for part in asked]
        served: dict[str, str] = {}
        for part, resolved in zip(asked, parts, strict=True):
            other = served.setdefault(resolved.ref, part.ref)
            if other != part.ref:
                raise bad_request(
                    f"{field}: {shown(other)} and {shown(part.ref)} are both served by {shown(resolved.ref)}; "
                    "name each adapter once"
                )
        return tuple(sorted(parts, key=lambda p: p.ref))

    def resolve_part(
        self, request: Request, part: MixPart, tenant: Tenant, active: ActivePolicy, models: Models
    ) -> MixedPart:
        """One part of a mix, resolved as a single adapter: a rollout to its variant, a catalog id to its version."""
        routed = self.route(request, part.ref, tenant, active)
        adapter = routed.adapter if routed is not None else part.ref
        pinned = self.pin(adapter, routed, active, models, mixed=True)
        ref = adapter if pinned is None else pinned.ref
        if routed is None:
            return MixedPart(ref, part.weight, pinned=pinned)
        return MixedPart(ref, part.weight, routed.rollout, routed.adapter, routed.how, pinned)

    @staticmethod
    def route(request: Request, name: str, tenant: Tenant, active: ActivePolicy) -> Routed | None:
        """The variant a rollout name is split to (sticky per its key); None when `name` is no rollout. A
        rollout's override header may answer 400 or 403."""
        if active.policy.rollout(name) is None:
            return None
        return active.rollouts.route(name, tenant, request.headers.get)

    def pin(
        self, adapter: str, routed: Routed | None, active: ActivePolicy, models: Models, mixed: bool
    ) -> Pinned | None:
        """The catalog version `adapter` names (None: no catalog id). 404 for an adapter no engine lists and
        the catalog does not hold (a catalog adapter no engine lists is not unknown: the engine fetches it),
        or a version its id does not have."""
        try:
            pinned = self.adapters.resolve(adapter)
            if pinned is None and models.all and adapter not in models.adapters:  # nothing learned: the engine says
                if mixed:
                    raise ApiError(
                        404, "adapter_not_found", f"adapter {shown(adapter)} (a part of the mix) is not loaded"
                    )
                raise adapter_not_found(adapter)
        except ApiError:
            if routed is not None:  # a variant nobody serves is the rollout's failure, not the client's
                self.observe_variant(active, routed.rollout, adapter, error=True, ttft_s=None)
            raise
        return pinned

    def fallback_call(self, call: Call, exchange: Exchange, response: Response, active: ActivePolicy) -> Call | None:
        """The same request for its rollout's first (stable) variant, when the split sent it to another
        variant and that variant failed it before any byte reached the client: the engine answered 500 (its
        adapter could not be computed) or its adapter could not be fetched, or is still being fetched. Else
        None. A canary's failures are judged against it (and roll it back) without failing the client's
        request; a variant the client named itself (the override header) answers for itself, and an engine
        that is merely busy (503) says nothing about the variant."""
        if exchange.delivered or not exchange.tried or isinstance(response, StreamingResponse):
            return None
        if exchange.outcome not in (*ADAPTER_REASONS, "upstream_500"):
            return None
        if call.parts:
            return self.fallback_mix(call, exchange, response, active)
        found = self.stable_variant(call.rollout, call.route, call.variant, active)
        if found is None:
            return None
        stable, pinned = found
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

    def fallback_mix(self, call: Call, exchange: Exchange, response: Response, active: ActivePolicy) -> Call | None:
        """`fallback_call` for a mix: every part a split sent to a variant other than its rollout's first goes
        to that first variant; None when no part changes (or two parts would then be one adapter)."""
        parts: list[MixedPart] = []
        for part in call.parts:
            found = self.stable_variant(part.rollout, part.route, part.variant, active)
            if found is None:
                parts.append(part)
                continue
            stable, pinned = found
            ref = pinned.ref if pinned is not None else stable
            parts.append(dataclasses.replace(part, ref=ref, variant=stable, pinned=pinned))
        if tuple(parts) == call.parts or len({p.ref for p in parts}) < len(parts):
            return None
        stable_call = with_mix(call, tuple(sorted(parts, key=lambda p: p.ref)))
        logger.info(
            "mix %s failed (%d %s); answering from %s",
            call.served,
            response.status_code,
            exchange.outcome,
            stable_call.served,
        )
        return stable_call

    def stable_variant(
        self, rollout_name: str | None, route: str | None, variant: str | None, active: ActivePolicy
    ) -> tuple[str, Pinned | None] | None:
        """The first (stable) variant of the rollout a split sent to `variant`, and its catalog version; None
        when the request was not split to another variant, or the stable one cannot be resolved."""
        if rollout_name is None or route != "split":
            return None
        rollout = active.policy.rollout(rollout_name)
        if rollout is None or not rollout.variants:
            return None
        stable = rollout.variants[0].adapter
        if stable == variant:
            return None
        try:
            return stable, self.adapters.resolve(stable)
        except ApiError:
            return None

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
        if call.parts and self.fleet.all_vllm():
            raise unavailable(
                "a mix of adapters is served by loragate engines only, and every upstream of this gateway is a vLLM "
                "engine",
                "no_upstream",
            )
        if exchange.limit_headers is None:  # the first attempt (a canary's fallback is charged once)
            exchange.limit_headers, exchange.reservation, exchange.hold = await self.gate.rate_limit(
                tenant, body.reserve_tokens, active
            )
        headers = dict(exchange.limit_headers)
        index = self.fleet.prefix
        chunks = index.chunks(call.body, call.path == CHAT_PATH, call.adapter)
        session = index.session(call.tenant, request.headers, call.body)
        unable = self.fleet.unable(call.adapter, catalog=bool(call.adapter_headers), mix=bool(call.parts))
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
        adapter, version = (served, "") if call is not None and call.parts else split_version(served)
        self.ledger.record(
            UsageRecord(
                request_id=call.request_id if call is not None else uuid.uuid4().hex,
                at=time.time(),
                tenant=tenant,
                adapter=adapter,
                version=version,
                rollout=rollouts_of(call),
                prompt_tokens=prompt,
                completion_tokens=completion,
                status=status,
                priority=call.priority.name.lower() if call is not None else "",
                latency_ms=round(latency_s * 1000, 1),
                trace_id=trace_id,
                parts=tuple(part_record(p) for p in call.parts) if call is not None else (),
            )
        )


def check_allowed(name: str, tenant: Tenant, active: ActivePolicy) -> None:
    """403 unless the tenant may use `name`: a rollout by its name, an adapter by its id without the version."""
    if not tenant.allows(name if active.policy.rollout(name) is not None else base_id(name)):
        raise ApiError(403, "permission_denied", f"adapter {shown(name)} is not allowed for tenant {tenant.id!r}")


def part_sources(parts: tuple[MixedPart, ...]) -> dict[str, str]:
    """X-Adapter-Part-Sources: the source of each catalog part's version, as Pinned.headers gives one adapter's
    (no header when no part is a catalog adapter)."""
    sources = [
        {
            "ref": p.pinned.ref,
            "source": p.pinned.version.source,
            "sha256": p.pinned.version.sha256,
            "size": p.pinned.version.size,
        }
        for p in parts
        if p.pinned is not None
    ]
    return {PART_SOURCES_HEADER: json.dumps(sources, separators=(",", ":"))} if sources else {}


def with_mix(call: Call, parts: tuple[MixedPart, ...]) -> Call:
    """`call` serving the mix of `parts` (by ref): its canonical name is the adapter sent (X-Adapter-ID and
    `model`), served and placed by (affinity, prefix index); its catalog parts' sources go with it."""
    name = mix_adapter(parts)
    return dataclasses.replace(
        call,
        body=upstream_body(call.body, name),
        adapter=name,
        served=name,
        parts=parts,
        adapter_headers=part_sources(parts),
        deprecated=any(p.pinned is not None and p.pinned.deprecated for p in parts),
        affinity=name if call.affinity is not None else None,
    )


def mix_adapter(parts: tuple[MixedPart, ...]) -> str:
    """The adapter a mix is served as: its parts' canonical mix_name, by the refs they resolved to."""
    return mix_name([MixPart(p.ref, p.weight) for p in parts])


def rollouts_of(call: Call | None) -> str:
    """The usage record's `rollout`: the rollout that chose the adapter, or those that chose a mix's parts
    (joined by '+'); "" when none did."""
    if call is None:
        return ""
    if call.parts:
        return "+".join(sorted({p.rollout for p in call.parts if p.rollout is not None}))
    return call.rollout or ""


def part_record(part: MixedPart) -> dict[str, Any]:
    """A mix's part in its usage record."""
    record: dict[str, Any] = {"adapter": part.ref, "weight": part.weight}
    if part.rollout is not None:
        record["rollout"] = part.rollout
    return record


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
            parts = await r.resolve_mix(request, body, tenant, active)
            adapter: str | None
            if parts:
                adapter, routed, pinned = mix_adapter(parts), None, None
            else:
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
        if parts:
            call = with_mix(call, parts)
        with request_span(
            self.operation, served, tenant=tenant.id, adapter=served, priority=priority.name.lower()
        ) as span:
            if routed is not None:
                span.set_attribute("loragate.rollout", routed.rollout)
                span.set_attribute("loragate.rollout.route", routed.how)  # split, override or rollback
            if parts:
                span.set_attribute("loragate.adapter.parts", [p.ref for p in parts])
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
                if call.parts:
                    r.metrics.count_mix_parts(tenant.id, [p.ref for p in call.parts], exchange.status)
                self._judge_variant(active, call, exchange)  # a stream: now that it has ended

    def _judge_variant(self, active: ActivePolicy, call: Call, exchange: Exchange) -> None:
        """Record a rollout request's outcome against its variant, once, if it reached an upstream (and
        the client did not leave first)."""
        if call.parts:
            variants = [(p.rollout, p.variant or p.ref) for p in call.parts if p.rollout is not None]
        elif call.rollout is not None:
            variants = [(call.rollout, call.variant if call.variant is not None else call.served)]
        else:
            return
        if not variants or exchange.judged or not exchange.tried or exchange.status == 499:
            return
        exchange.judged = True
        # An engine's 503 (overloaded, draining) says "not now", nothing about the variant.
        error = exchange.status >= 500 and exchange.status != 503 or exchange.outcome == "upstream_error"
        for rollout, variant in variants:  # a mix's: each part a rollout chose, as if it had been named alone
            self.r.observe_variant(active, rollout, variant, error, exchange.ttft_s)
