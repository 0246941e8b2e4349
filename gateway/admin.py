"""The routes only an admin key may call, and the ops page that drives them.

  GET  /admin/policy                      the active policy, its reload state, rollouts, routing, queues,
                                          per-tenant counts, overrides and the latest operator actions
  POST /admin/reload                      reload the policy file now (gateway/reload.py); clears overrides
  POST /admin/rollouts/{name}/{action}    pause | resume | promote | rollback | reset (gateway/rollout.py)
  POST /admin/upstreams/{action}          drain | undrain | reset-breaker, body {"url": ...}
  POST /admin/tenants/{id}/{action}       suspend | resume, body {"reason": ...} (optional)
  POST /admin/overrides/clear             lift every suspension and drain (gateway/overrides.py)
  GET  /admin/usage                       the usage ledger summed (gateway/usage.py): ?since=&until=
                                          (default: this UTC month), &tenant=, &by=tenant,adapter,day
  GET  /admin/ui                          the ops page (gateway/ops.html): it holds no data of its own
  /admin/adapters[/{id}]                  the adapter catalog (gateway/adapter_admin.py); tenants that may
                                          publish reach their own namespace there with their API key

Auth is the `Authorization: Bearer <admin key>` header only: no cookie, no key in a URL. A page on another
site can neither read these answers nor trigger an action (a cross-site form cannot set that header, and
a cross-origin fetch that sets it needs a CORS preflight this app never grants), so no CSRF token is needed.

Every action is idempotent: repeating it answers 200 with `"changed": false`. Each one is logged (who,
what, when, and whether it changed anything), counted in `loragate_gateway_admin_actions_total{action,
changed}` and kept in a short log shown by GET /admin/policy (shared through Redis, so any replica shows
the fleet's). Who: the admin key's fingerprint (the first 12 hex digits of its sha256), plus the
`X-Loragate-Actor` header when the caller names itself (`loragate admin` sends the user's login name).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import time
from collections import deque
from importlib import resources
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.adapter_catalog import AdapterCatalog
from gateway.auth import Authenticator
from gateway.clock import iso_time
from gateway.fleet import Fleet
from gateway.fleet_store import FleetStore
from gateway.overrides import BREAKER, TENANT, UPSTREAM
from gateway.policy import PolicyError
from gateway.redis_client import UNREACHABLE, breakers_of
from gateway.reload import PolicyStore
from gateway.rollout import Rollouts
from gateway.telemetry import GatewayMetrics
from gateway.usage import USAGE_KEYS, UsageLedger, aggregate, day_start, month_start, parse_when
from loragate_common.errors import ApiError, bad_request, shown, unauthorized, unavailable
from loragate_common.http_io import read_json

logger = logging.getLogger(__name__)

UPSTREAM_ACTIONS = ("drain", "undrain", "reset-breaker")
TENANT_ACTIONS = ("suspend", "resume")
LOG_KEY = "loragate:admin-log"
LOG_KEEP = 200  # actions kept in the log
LOG_SHOWN = 50  # of which GET /admin/policy shows the newest
MAX_ACTOR = 64
MAX_REASON = 200
ADMIN_BODY_BYTES = 16 << 10
USAGE_TODAY_S = 10.0  # the ops page's usage of today is read from the ledger at most this often


def not_found(message: str) -> ApiError:
    return ApiError(404, "not_found", message)


def key_fingerprint(authorization: str | None) -> str:
    """The first 12 hex digits of the sha256 of the key in `Bearer <key>`: who, in logs, without the key."""
    key = (authorization or "").strip().partition(" ")[2].strip()
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def admin_who(request: Request, auth: Authenticator) -> str | None:
    """An admin caller's name for the action log: the key's fingerprint, after the X-Loragate-Actor it names
    itself by, if any; None when the request carries no admin key."""
    authorization = request.headers.get("authorization")
    if not auth.is_admin(authorization):
        return None
    who = f"key:{key_fingerprint(authorization)}"
    actor = "".join(c for c in request.headers.get("x-loragate-actor", "") if c.isprintable()).strip()
    return f"{actor[:MAX_ACTOR]} ({who})" if actor else who


def _text(value: Any, field: str, limit: int) -> str:
    """A short free-text value from an admin body (a reason, a URL): a string, control characters removed."""
    if not isinstance(value, str):
        raise bad_request(f"{field}: must be a string")
    if len(value) > limit:
        raise bad_request(f"{field}: at most {limit} characters")
    return "".join(c for c in value if c.isprintable()).strip()


class OpsPage:
    """gateway/ops.html with a Content-Security-Policy that lets only its own inline script and style run."""

    def __init__(self) -> None:
        self.html = resources.files("gateway").joinpath("ops.html").read_text(encoding="utf-8")
        hashes = {}
        for tag in ("script", "style"):
            body = self.html.split(f"<{tag}>", 1)[1].split(f"</{tag}>", 1)[0]
            digest = hashlib.sha256(body.encode()).digest()
            hashes[tag] = "'sha256-" + base64.b64encode(digest).decode() + "'"
        self.headers = {
            "Content-Security-Policy": (
                f"default-src 'none'; script-src {hashes['script']}; style-src "
                f"{hashes['style']}; connect-src 'self'; img-src 'self' data:; "
                "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
            ),
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-store",
            "X-Frame-Options": "DENY",
        }


class AdminRoutes:
    """The /admin/* routes over the parts they act on: the policy, the engines, the fleet's shared store."""

    def __init__(
        self,
        store: PolicyStore,
        fleet: Fleet,
        metrics: GatewayMetrics,
        fleet_store: FleetStore,
        ledger: UsageLedger,
        adapters: AdapterCatalog,
    ) -> None:
        self.ledger = ledger
        self.adapters = adapters
        self._today: tuple[float, list[dict[str, Any]]] | None = None  # (when read, rows): the ops page's
        self.store = store
        self.fleet = fleet
        self.metrics = metrics
        self.fleet_store = fleet_store
        self.log: deque[dict[str, Any]] = deque(maxlen=LOG_KEEP)  # this replica's actions (no Redis)
        self._page: OpsPage | None = None

    def routes(self) -> list[Route]:
        return [
            Route("/admin/policy", self.policy, methods=["GET"]),
            Route("/admin/reload", self.reload, methods=["POST"]),
            Route("/admin/rollouts/{name}/{action}", self.rollout, methods=["POST"]),
            Route("/admin/upstreams/{action}", self.upstream, methods=["POST"]),
            Route("/admin/tenants/{id}/{action}", self.tenant, methods=["POST"]),
            Route("/admin/overrides/clear", self.clear_overrides, methods=["POST"]),
            Route("/admin/usage", self.usage, methods=["GET"]),
            Route("/admin/ui", self.ui, methods=["GET"]),
        ]

    # ---- auth ----

    def _require_admin(self, request: Request) -> str:
        """The caller's name for the log; 401 without an admin key."""
        who = admin_who(request, self.store.active.auth)
        if who is None:
            raise unauthorized("an admin key is required (Authorization: Bearer <admin key>)")
        return who

    # ---- reading ----

    async def policy(self, request: Request) -> Response:
        self._require_admin(request)
        return JSONResponse(await self.state())

    async def state(self) -> dict[str, Any]:
        fleet = self.fleet
        tenants = {}
        for tenant in self.store.active.policy.tenants:
            suspended = fleet.overrides.suspended(tenant.id)
            tenants[tenant.id] = {
                **self.metrics.tally(tenant.id),
                "suspended": suspended.to_json() if suspended is not None else None,
            }
        return {
            "usage_today": await self._usage_today(),
            **self.store.describe(),
            "routing": fleet.routing(),
            "queues": fleet.admission.queue_depths(),
            "tenants": tenants,
            "overrides": fleet.overrides.describe(),
            # The Redis breaker (gateway/redis_client.py), one per Redis; null without --redis.
            "redis": next((b.describe() for b in breakers_of(self.fleet_store)), None),
            "actions": await self._read_log(),
            "now": iso_time(time.time()),
        }

    async def _usage_today(self) -> list[dict[str, Any]] | None:
        """Today's (UTC) usage per tenant for the ops page, read at most every USAGE_TODAY_S; None while
        the ledger's store is unreachable."""
        now = time.time()
        if self._today is None or now - self._today[0] >= USAGE_TODAY_S:
            try:
                rows = aggregate(await self.ledger.read(day_start(now), now + 1), ["tenant"])
            except UNREACHABLE as exc:
                logger.warning("could not read the usage ledger: %s", exc)
                return None
            self._today = (now, rows)
        return self._today[1]

    async def usage(self, request: Request) -> Response:
        self._require_admin(request)
        query = request.query_params
        now = time.time()
        try:
            since = parse_when(query["since"], now) if "since" in query else month_start(now)
            until = parse_when(query["until"], now) if "until" in query else now + 1
        except ValueError as exc:
            raise bad_request(f"since/until: {exc}") from None
        by = [key.strip() for key in query.get("by", "tenant").split(",") if key.strip()]
        unknown = [key for key in by if key not in USAGE_KEYS]
        if unknown:
            raise bad_request(f"by: unknown key {shown(unknown[0])} (any of: {', '.join(USAGE_KEYS)})")
        try:
            records = await self.ledger.read(since, until)
        except UNREACHABLE as exc:
            raise unavailable(f"the usage ledger's store is unreachable: {exc}", "redis_unavailable") from None
        tenant = query.get("tenant")
        if tenant is not None:
            records = [r for r in records if r.tenant == tenant]
        return JSONResponse(aggregate(records, by))

    async def _read_log(self) -> list[dict[str, Any]]:
        share = self.fleet_store
        if share.shared:
            try:
                return [json.loads(line) for line in await share.read_log(LOG_KEY, LOG_SHOWN)]
            except Exception as exc:  # Redis down: this replica's own
                logger.warning("could not read the shared admin log: %s", exc)
        return list(self.log)[-LOG_SHOWN:][::-1]

    # ---- acting ----

    async def record(self, who: str, action: str, target: str, changed: bool, detail: str = "") -> None:
        """Log, count and keep one operator action (the shared log too, with Redis)."""
        entry = {"at": iso_time(time.time()), "by": who, "action": action, "target": target, "changed": changed}
        if detail:
            entry["detail"] = detail
        logger.info(
            "admin action %s %s by %s: %s%s",
            action,
            target,
            who,
            "changed" if changed else "no change",
            f" ({detail})" if detail else "",
        )
        self.metrics.count_admin_action(action, changed)
        self.log.append(entry)
        share = self.fleet_store
        if share.shared:
            try:
                await share.push_log(LOG_KEY, json.dumps(entry), LOG_KEEP)
            except Exception as exc:
                logger.warning("could not write the shared admin log: %s", exc)

    async def reload(self, request: Request) -> Response:
        """Reload the file now: every rollout starts afresh and every override is lifted, here and (through
        Redis) on every replica."""
        who = self._require_admin(request)
        try:
            active = self.store.reload(self.adapters.served(await self.fleet.served_adapters()), fresh=True)
        except PolicyError as exc:
            await self.record(who, "reload", "policy", False, "refused")
            raise ApiError(400, "invalid_policy", str(exc)) from None
        try:
            await active.rollouts.clear_shared()
        except Exception as exc:  # Redis down: this replica is fresh, the others keep a shared rollback
            logger.warning("could not clear the shared rollbacks: %s", exc)
        await self.fleet.clear_overrides()
        await self.record(who, "reload", "policy", True, f"sha256 {active.sha256[:12]}")
        return JSONResponse(self.store.describe())

    async def rollout(self, request: Request) -> Response:
        who = self._require_admin(request)
        name, action = request.path_params["name"], request.path_params["action"]
        rollouts = self.store.active.rollouts
        if action not in Rollouts.ACTIONS:
            raise not_found(f"unknown rollout action {shown(action)} (one of: {', '.join(Rollouts.ACTIONS)})")
        if name not in rollouts.states:
            raise not_found(f"no rollout named {shown(name)} in the active policy")
        try:
            changed = await rollouts.act(name, action, who)
        except ValueError as exc:
            raise ApiError(409, "conflict", str(exc)) from None
        await self.record(who, f"rollout.{action}", name, changed)
        return JSONResponse(
            {
                "action": action,
                "rollout": name,
                "changed": changed,
                "state": rollouts.states[name].describe(time.monotonic()),
            }
        )

    async def upstream(self, request: Request) -> Response:
        who = self._require_admin(request)
        action = request.path_params["action"]
        if action not in UPSTREAM_ACTIONS:
            raise not_found(f"unknown upstream action {shown(action)} (one of: {', '.join(UPSTREAM_ACTIONS)})")
        data = await read_json(request, ADMIN_BODY_BYTES)
        if "url" not in data:
            raise bad_request('body: give the upstream as {"url": "http://..."} (GET /admin/policy lists them)')
        url = _text(data["url"], "url", 2048).rstrip("/")
        upstream = self.fleet.upstream(url)
        if upstream is None:
            raise not_found(f"no upstream {shown(url)} (GET /admin/policy lists them under routing.upstreams)")
        overrides = self.fleet.overrides
        if action == "drain":
            changed = await overrides.put(UPSTREAM, url, "drained by an operator", who)
        elif action == "undrain":
            changed = await overrides.remove(UPSTREAM, url)
        else:
            changed = upstream.breaker.reset()
            await overrides.put(BREAKER, url, "reset by an operator", who)  # the other replicas reset theirs
        self.fleet.apply_overrides()
        await self.record(who, f"upstream.{action}", url, changed)
        return JSONResponse(
            {"action": action, "upstream": url, "changed": changed, "state": self.fleet.upstream_state(upstream)}
        )

    async def tenant(self, request: Request) -> Response:
        who = self._require_admin(request)
        tenant_id, action = request.path_params["id"], request.path_params["action"]
        if action not in TENANT_ACTIONS:
            raise not_found(f"unknown tenant action {shown(action)} (one of: {', '.join(TENANT_ACTIONS)})")
        if self.store.active.policy.tenant(tenant_id) is None:
            raise not_found(f"no tenant {shown(tenant_id)} in the active policy")
        overrides = self.fleet.overrides
        if action == "suspend":
            data = await read_json(request, ADMIN_BODY_BYTES, optional=True)
            reason = _text(data.get("reason", ""), "reason", MAX_REASON) or "suspended by an operator"
            changed = await overrides.put(TENANT, tenant_id, reason, who)
        else:
            changed = await overrides.remove(TENANT, tenant_id)
        await self.record(who, f"tenant.{action}", tenant_id, changed)
        suspended = overrides.suspended(tenant_id)
        return JSONResponse(
            {
                "action": action,
                "tenant": tenant_id,
                "changed": changed,
                "suspended": suspended.to_json() if suspended is not None else None,
            }
        )

    async def clear_overrides(self, request: Request) -> Response:
        who = self._require_admin(request)
        had = self.fleet.overrides.describe()
        changed = bool(had["suspended_tenants"] or had["drained_upstreams"])
        await self.fleet.clear_overrides()
        await self.record(who, "overrides.clear", "all", changed)
        return JSONResponse({"action": "clear", "changed": changed, "overrides": self.fleet.overrides.describe()})

    # ---- the page ----

    async def ui(self, request: Request) -> Response:
        """The ops page. It is the same for everyone and holds no data: it asks for the admin key and reads
        GET /admin/policy with it, so serving it needs no key (and the key never appears in a URL)."""
        if self._page is None:
            self._page = OpsPage()
        return Response(self._page.html, media_type="text/html; charset=utf-8", headers=self._page.headers)
