"""The adapter catalog's routes (gateway/adapter_catalog.py), for operators and for tenants that publish.

  GET    /admin/adapters[?tenant=T]        every id (or tenant T's), its versions, each one's state on each engine
  POST   /admin/adapters                   register {id, source, sha256, size?, revision?, tenant?}: 201 with a new
                                           version; 200 `changed: false` when source and sha256 are the newest's
  GET    /admin/adapters/{id}              one id, or one version (`ID@N`), with its state on each engine
  POST   /admin/adapters/{id}/deprecate    an id or `ID@N`; the body {"deprecated": false} takes it back
  DELETE /admin/adapters/{id}              an id (all its versions) or `ID@N`

Ids hold a '/' (`tenant/name`): the route's `{id}` is the rest of the path (percent-encoded or not).

Who: an admin key, as every /admin/ route; or the API key of a tenant whose policy says `publish: true`,
for the ids of its own namespace only (`<tenant>/<name>`; 403 for any other), within its `publish_quota`
(`max_adapters`: versions of its ids, deleted ones not counted; `max_bytes`: the sum of their declared sizes,
which a tenant must therefore declare: the engine checks the size when it fetches). The catalog records who
published each version (the tenant id, or `admin:<key fingerprint>`); every change is in the admin log.

A version's state on an engine comes from the engine's GET /v1/adapters (a vLLM engine's: its agent's,
vllm_agent/; read from every engine at once, each given ENGINE_TIMEOUT_S): the card of `ID@N` (state, error,
last_used, loads, evictions, sha256), "not loaded" when the engine does not list it, "unknown" when the engine did
not answer (or is a vLLM engine without an agent). Tenants see the engines as
`engine-0`, `engine-1`, ... rather than by URL.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.adapter_catalog import AdapterCatalog, Quota, Registration
from gateway.admin import ADMIN_BODY_BYTES, admin_who, key_fingerprint
from gateway.admission import Upstream
from gateway.catalog_entry import CatalogEntry, check_sha256
from gateway.catalog_store import CatalogBusy
from gateway.engine_kinds import EngineKind
from gateway.fleet import Fleet
from gateway.policy import Tenant
from gateway.redis_client import UNREACHABLE
from gateway.reload import PolicyStore
from loragate_common.adapter_ids import check_id, check_ref
from loragate_common.adapter_sources import AllowList, SourceError, parse_source
from loragate_common.errors import ApiError, bad_request, shown, unauthorized, unavailable
from loragate_common.http_io import read_json

ENGINE_TIMEOUT_S = 1.0
REGISTER_FIELDS = ("id", "source", "sha256", "size", "revision", "tenant")
MAX_SOURCE_CHARS = 2048
MAX_REVISION_CHARS = 200
ARCHIVE_KINDS = ("https", "http")  # sources whose digest is the archive's, which only the publisher knows

Record = Callable[[str, str, str, bool], Awaitable[None]]  # who, action, target, changed: the admin log


@dataclass(frozen=True, slots=True)
class Caller:
    who: str  # for the admin log
    published_by: str  # what the catalog records
    tenant: Tenant | None  # a publishing tenant, acting on its own namespace; None: an admin


@dataclass(frozen=True, slots=True)
class EngineCards:
    """One engine's GET /v1/adapters: its cards by id, or why there are none."""

    url: str
    cards: dict[str, dict[str, Any]] | None
    error: str | None
    # An engine lists a download in progress, a failed one, and a cached one no id is registered from yet
    # (after a restart) by digest, with no id: engine/entrypoints/fetched_adapters.py pending_cards.
    pending: dict[str, dict[str, Any]] = field(default_factory=dict)

    def state(self, ref: str, sha256: str | None = None) -> dict[str, Any]:
        if self.cards is None:
            return {"state": "unknown", "error": self.error}
        card = self.cards.get(ref) or (self.pending.get(sha256) if sha256 is not None else None)
        if card is None:
            return {"state": "not loaded"}
        fields = ("error", "last_used", "loads", "evictions", "sha256")
        state = card.get("state") or card.get("residence") or "unknown"
        return {"state": state, **{f: card.get(f) for f in fields}, "adapter": _summary(card)}


def _summary(card: dict[str, Any]) -> dict[str, Any] | None:
    """What an engine's card says the adapter is (loragate_common/adapter_kinds.py): a loragate engine's card carries
    kind, rank and target_modules; a card of the disk cache (a vLLM agent's, or a download no id is registered from
    yet) carries the fetcher's `adapter`."""
    summary = card.get("adapter")
    if isinstance(summary, dict):
        return summary
    if card.get("kind"):
        return {f: card.get(f) for f in ("kind", "rank", "target_modules")}
    return None


class AdapterRoutes:
    """The /admin/adapters routes over the catalog, the active policy and the engines."""

    def __init__(self, catalog: AdapterCatalog, store: PolicyStore, fleet: Fleet, record: Record) -> None:
        self.catalog = catalog
        self.store = store
        self.fleet = fleet
        self.record = record

    def routes(self) -> list[Route]:
        return [
            Route("/admin/adapters", self.list_adapters, methods=["GET"]),
            Route("/admin/adapters", self.register, methods=["POST"]),
            Route("/admin/adapters/{ref:path}/deprecate", self.deprecate, methods=["POST"]),
            Route("/admin/adapters/{ref:path}", self.show, methods=["GET"]),
            Route("/admin/adapters/{ref:path}", self.delete, methods=["DELETE"]),
        ]

    # ---- who ----

    def _caller(self, request: Request) -> Caller:
        """An admin, or a tenant that may publish; 401 for any other key, 403 for a tenant that may not."""
        active = self.store.active
        authorization = request.headers.get("authorization")
        who = admin_who(request, active.auth)
        if who is not None:
            return Caller(who, f"admin:{key_fingerprint(authorization)}", None)
        tenant = active.auth.tenant_for(authorization)
        if tenant is None:
            raise unauthorized("an admin key, or the API key of a tenant that may publish, is required")
        if not tenant.publish:
            raise ApiError(403, "permission_denied", f"tenant {tenant.id!r} may not publish adapters")
        if self.fleet.overrides.suspended(tenant.id) is not None:
            raise ApiError(403, "tenant_suspended", f"tenant {tenant.id!r} is suspended")
        return Caller(f"tenant:{tenant.id}", tenant.id, tenant)

    @staticmethod
    def _own(caller: Caller, adapter_id: str) -> None:
        if caller.tenant is not None and not adapter_id.startswith(f"{caller.tenant.id}/"):
            raise ApiError(
                403,
                "permission_denied",
                f"tenant {caller.tenant.id!r} may only publish adapters named {caller.tenant.id}/<name>, "
                f"not {shown(adapter_id)}",
            )

    # ---- reading ----

    async def list_adapters(self, request: Request) -> Response:
        caller = self._caller(request)
        tenant = request.query_params.get("tenant")
        if caller.tenant is not None:
            if tenant not in (None, caller.tenant.id):
                raise ApiError(403, "permission_denied", f"tenant {caller.tenant.id!r} may list only its own")
            entries = self.catalog.listed(namespace=caller.tenant.id)
        else:
            entries = self.catalog.listed(tenant=tenant)
        engines = await self._engines(caller)
        body = {
            "object": "list",
            "data": [self._describe(e, engines) for e in entries],
            "engines": [{"url": e.url, "reachable": e.cards is not None, "error": e.error} for e in engines],
        }
        return JSONResponse(body)

    async def show(self, request: Request) -> Response:
        caller = self._caller(request)
        adapter_id, number = check_ref(request.path_params["ref"])
        self._own(caller, adapter_id)
        entry = self.catalog.get(adapter_id)
        if entry is None:
            raise ApiError(404, "not_found", f"no adapter {adapter_id!r} in the catalog")
        if number is not None and entry.version(number) is None:
            raise ApiError(404, "not_found", f"adapter {adapter_id!r} has no version {number}")
        body = self._describe(entry, await self._engines(caller))
        if number is not None:  # the entry as it is (its current version too), that version only
            body["versions"] = [v for v in body["versions"] if v["version"] == number]
        return JSONResponse(body)

    def _describe(self, entry: CatalogEntry, engines: list[EngineCards]) -> dict[str, Any]:
        digests = {f"{entry.id}@{v.version}": v.sha256 for v in entry.versions}
        body = entry.describe(lambda ref: {e.url: e.state(ref, digests.get(ref)) for e in engines})
        for version in body["versions"]:  # what the version is: from the first engine that has read its files
            cards = version["engines"].values()
            version["adapter"] = next((c["adapter"] for c in cards if c.get("adapter")), None)
        return body

    async def _engines(self, caller: Caller) -> list[EngineCards]:
        """Every engine's cards, read at once; a tenant sees the engines by position, not by URL."""
        client = self.fleet.catalog.client

        async def one(upstream: Upstream) -> EngineCards:
            url = upstream.url
            if upstream.kind is EngineKind.VLLM and upstream.agent is None:
                return EngineCards(url, None, "a vLLM engine without an agent: catalog adapters do not reach it")
            listing = url if upstream.kind is EngineKind.LORAGATE else upstream.agent  # a vLLM engine's: its agent's
            try:
                resp = await client.get(f"{listing}/v1/adapters", timeout=ENGINE_TIMEOUT_S)
                resp.raise_for_status()
                listed = [c for c in resp.json()["data"] if isinstance(c, dict)]
                cards = {str(c["id"]): c for c in listed if c.get("id") is not None}
                pending = {str(c["sha256"]): c for c in listed if c.get("id") is None and c.get("sha256")}
            except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
                return EngineCards(url, None, f"GET /v1/adapters failed: {type(exc).__name__}")
            return EngineCards(url, cards, None, pending)

        found = await asyncio.gather(*(one(u) for u in self.fleet.admission.upstreams))
        if caller.tenant is not None:
            found = [EngineCards(f"engine-{i}", e.cards, e.error, e.pending) for i, e in enumerate(found)]
        return list(found)

    # ---- acting ----

    async def _unload(self, refs: list[str]) -> None:
        """Best effort: the engines unregister deleted versions now (DELETE /v1/adapters/ID@N), rather than
        serving them to a request that names one until their caches evict them (a vLLM engine: its runtime
        unload). An engine that does not hold one answers 404; one that does not answer keeps it until its cache
        evicts it."""
        client = self.fleet.catalog.client

        async def one(upstream: Upstream, ref: str) -> None:
            with contextlib.suppress(httpx.HTTPError):
                if upstream.kind is EngineKind.VLLM:
                    await client.post(
                        f"{upstream.url}/v1/unload_lora_adapter", json={"lora_name": ref}, timeout=ENGINE_TIMEOUT_S
                    )
                else:
                    await client.delete(f"{upstream.url}/v1/adapters/{ref}", timeout=ENGINE_TIMEOUT_S)

        await asyncio.gather(*(one(u, ref) for u in self.fleet.admission.upstreams for ref in refs))

    async def register(self, request: Request) -> Response:
        caller = self._caller(request)
        reg = self._registration(await read_json(request, ADMIN_BODY_BYTES), caller)
        quota = None
        if caller.tenant is not None:
            limits = caller.tenant.publish_quota
            quota = Quota(caller.tenant.id, limits.max_adapters, limits.max_bytes)
        async with _store_errors():
            entry, version, changed = await self.catalog.register(reg, quota)
        ref = f"{entry.id}@{version.version}"
        await self.record(caller.who, "adapter.register", ref, changed)
        body = {"action": "register", "changed": changed, "ref": ref, "adapter": entry.describe()}
        return JSONResponse(body, status_code=201 if changed else 200)

    def _registration(self, data: dict[str, Any], caller: Caller) -> Registration:
        """The body of POST /admin/adapters, checked; 400 naming the field at fault."""
        unknown = sorted(set(data) - set(REGISTER_FIELDS))
        if unknown:
            raise bad_request(f"{unknown[0]}: unknown field (expected: {', '.join(REGISTER_FIELDS)})")
        adapter_id = check_id(data.get("id"), "id")
        self._own(caller, adapter_id)
        text = data.get("source")
        if not isinstance(text, str) or not text.strip() or len(text) > MAX_SOURCE_CHARS:
            raise bad_request(f"source: must be a source URI of 1 to {MAX_SOURCE_CHARS} characters")
        try:
            source = parse_source(text.strip())
        except SourceError as exc:
            raise bad_request(f"source: {exc}") from None
        if caller.tenant is not None and not AllowList(caller.tenant.publish_sources).allows(source):
            allowed = ", ".join(caller.tenant.publish_sources)
            raise ApiError(
                403,
                "permission_denied",
                f"source: tenant {caller.tenant.id!r} may publish only from its publish_sources ({allowed})",
            )
        if data.get("sha256") is None:
            what = "the archive's sha256" if source.kind in ARCHIVE_KINDS else "the adapter's content digest"
            raise bad_request(
                f"sha256: required: {what} (`loragate adapters register` computes it for s3, hf and local sources)"
            )
        size = data.get("size")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise bad_request("size: must be a positive number of bytes")
        if size is None and caller.tenant is not None:
            raise bad_request("size: required when a tenant publishes (its quota counts bytes)")
        return Registration(
            id=adapter_id,
            source=str(source),
            sha256=check_sha256(data.get("sha256")),
            size=size,
            revision=_revision(data.get("revision")),
            tenant=self._tenant_of(adapter_id, data.get("tenant"), caller),
            published_by=caller.published_by,
        )

    def _tenant_of(self, adapter_id: str, given: Any, caller: Caller) -> str | None:
        """The entry's tenant: the publishing tenant; else the one named (it must exist, and own the id's
        namespace if the id has one), else the namespace."""
        namespace = adapter_id.partition("/")[0] if "/" in adapter_id else None
        if given is not None and not isinstance(given, str):
            raise bad_request("tenant: must be a string")
        if caller.tenant is not None:
            if given not in (None, caller.tenant.id):
                raise ApiError(403, "permission_denied", f"tenant {caller.tenant.id!r} publishes for itself only")
            return caller.tenant.id
        if given is None:
            return namespace
        if self.store.active.policy.tenant(given) is None:
            raise bad_request(f"tenant: no tenant {shown(given)} in the active policy")
        if namespace is not None and given != namespace:
            raise bad_request(f"tenant: the id's namespace is {namespace!r}, so its tenant is too")
        return given

    async def deprecate(self, request: Request) -> Response:
        caller = self._caller(request)
        adapter_id, number = check_ref(request.path_params["ref"])
        self._own(caller, adapter_id)
        data = await read_json(request, ADMIN_BODY_BYTES, optional=True)
        deprecated = data.get("deprecated", True)
        if not isinstance(deprecated, bool):
            raise bad_request("deprecated: must be true or false")
        async with _store_errors():
            entry, changed = await self.catalog.deprecate(adapter_id, number, deprecated)
        target = request.path_params["ref"]
        await self.record(caller.who, "adapter.deprecate" if deprecated else "adapter.undeprecate", target, changed)
        body = {"action": "deprecate", "deprecated": deprecated, "target": target, "changed": changed}
        return JSONResponse({**body, "adapter": entry.describe()})

    async def delete(self, request: Request) -> Response:
        caller = self._caller(request)
        adapter_id, number = check_ref(request.path_params["ref"])
        self._own(caller, adapter_id)
        known = self.catalog.get(adapter_id)
        before = known.versions if known is not None else ()
        async with _store_errors():
            entry = await self.catalog.delete(adapter_id, number)
        target = request.path_params["ref"]
        await self.record(caller.who, "adapter.delete", target, True)
        gone = [f"{adapter_id}@{number}"] if number is not None else [f"{adapter_id}@{v.version}" for v in before]
        await self._unload(gone)
        remaining = entry.describe() if entry.versions else None
        return JSONResponse({"action": "delete", "target": target, "changed": True, "adapter": remaining})


@contextlib.asynccontextmanager
async def _store_errors() -> AsyncIterator[None]:
    """The store's failures as 503s: unreachable (Redis down), or too busy (writers kept colliding)."""
    try:
        yield
    except UNREACHABLE as exc:
        raise unavailable(f"the adapter catalog's store is unreachable: {exc}", "redis_unavailable") from None
    except CatalogBusy as exc:
        raise unavailable(str(exc), "catalog_busy") from None


def _revision(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_REVISION_CHARS or not value.isprintable():
        raise bad_request(f"revision: must be a printable string of 1 to {MAX_REVISION_CHARS} characters")
    return value
