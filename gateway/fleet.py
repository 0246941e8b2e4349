"""The engines a gateway serves from, and the operators' hold on them: `Fleet`.

It owns the upstream set (the static `--upstream` engines plus those `--upstream-dns` finds, gateway/discovery.py;
each a loragate or a vLLM engine, gateway/engine_kinds.py),
admission over them (gateway/admission.py: per-engine slots, priority queues, adapter affinity), which engine
holds which prompt prefix and session (gateway/prefix_index.py), what the engines serve (gateway/upstream.py's
catalog of base models and adapters), and operator overrides that act on engines (drains and breaker resets,
gateway/overrides.py). Generation, the admin routes and the
housekeeping loop all reach the engines through it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import httpx

from gateway import vllm
from gateway.admission import AdmissionController, EngineLoad, Upstream
from gateway.breaker import CircuitBreaker
from gateway.discovery import DnsUpstreams
from gateway.engine_kinds import EngineKind, EngineTarget
from gateway.overrides import Overrides
from gateway.policy import Breaker, Policy
from gateway.prefix_index import PrefixIndex
from gateway.reload import PolicyStore
from gateway.upstream import UpstreamCatalog

logger = logging.getLogger(__name__)

LOAD_POLL_S = 1.0  # how often each engine's GET /load is read (its answers' X-Loragate-Load in between)
LOAD_TIMEOUT_S = 1.0


def new_breaker(settings: Breaker) -> CircuitBreaker:
    return CircuitBreaker(settings.failure_threshold, settings.open_seconds, settings.half_open_probes)


class Fleet:
    """The upstream engines: which ones, their load and breakers, what they serve, which are drained."""

    def __init__(
        self,
        store: PolicyStore,
        admission: AdmissionController,
        catalog: UpstreamCatalog,
        overrides: Overrides,
        prefix: PrefixIndex,
        discoveries: Sequence[DnsUpstreams] = (),
    ) -> None:
        self.store = store
        self.admission = admission
        self.prefix = prefix
        self.catalog = catalog
        self.overrides = overrides
        self.discoveries = list(discoveries)
        self.discovered: dict[int, list[EngineTarget]] = {}  # per DNS name (its index), its last answer
        self.static_targets = [EngineTarget(u.url, u.kind, u.agent) for u in admission.upstreams]
        self.draining = False

    # ---- which engines ----

    def set_upstreams(self, targets: list[EngineTarget]) -> None:
        """Serve from exactly these engines (the static ones plus those discovered in DNS): new ones join with
        a fresh breaker, vanished ones get no new request and their requests in flight finish."""
        current = {u.url: u for u in self.admission.upstreams}
        wanted = {t.url: t for t in targets}
        if set(wanted) == set(current):
            return
        settings = self.store.active.policy.breaker
        upstreams = [current.get(t.url) or Upstream(t.url, new_breaker(settings), t.kind, t.agent) for t in targets]
        joined, left = sorted(set(wanted) - set(current)), sorted(set(current) - set(wanted))
        logger.info(
            "upstreams: %d (joined %s; left %s)", len(targets), ", ".join(joined) or "none", ", ".join(left) or "none"
        )
        self.admission.set_upstreams(upstreams)
        self.prefix.forget(left)
        self.apply_overrides()
        self.catalog.invalidate()

    async def discover(self) -> None:
        """Resolve the engines' DNS names once and serve from what they say (with the static upstreams); a name
        whose resolver failed keeps its last answer."""
        if not self.discoveries:
            return
        found = await asyncio.gather(*(d.targets() for d in self.discoveries))
        for i, targets in enumerate(found):
            if targets is not None:
                self.discovered[i] = targets
        merged = {t.url: t for t in self.static_targets}
        for targets in self.discovered.values():
            merged.update({t.url: t for t in targets if t.url not in merged})
        self.set_upstreams(sorted(merged.values(), key=lambda t: t.url))

    async def discovering(self) -> None:
        """Until cancelled: `discover()` every `interval_s` of the DNS names (the shortest)."""
        interval = min(d.interval_s for d in self.discoveries)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.discover()
            except Exception:
                logger.exception("engine discovery failed")

    async def poll_loads(self) -> None:
        """Read every engine's load report once: a loragate engine's GET /load (its running and waiting
        requests, the adapters on its device and the prompt prefixes its cache holds), a vLLM engine's
        /metrics and /v1/models (gateway/vllm.py). An engine without the route, or that does not answer,
        keeps its last."""
        client = self.catalog.client

        async def one(upstream: Upstream) -> None:
            if upstream.kind is EngineKind.VLLM:
                await vllm.poll(client, upstream)
                return
            try:
                resp = await client.get(f"{upstream.url}/load", timeout=LOAD_TIMEOUT_S)
                resp.raise_for_status()
                data = resp.json()
                upstream.reported = EngineLoad(int(data["running"]), int(data["waiting"]), time.monotonic())
                upstream.on_device = frozenset(str(a) for a in data.get("device_adapters", ()))
                slots = data.get("max_device_adapters")
                upstream.device_slots = slots if isinstance(slots, int) and slots > 0 else None
                prefixes = data.get("prefixes")
                if isinstance(prefixes, list) and all(isinstance(h, str) for h in prefixes):
                    self.prefix.report(upstream.url, prefixes)
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                pass  # the breaker and the catalog notice engines that are down; this is only a hint

        await asyncio.gather(*(one(u) for u in self.admission.upstreams))

    async def polling_loads(self) -> None:
        """Until cancelled: `poll_loads()` every LOAD_POLL_S."""
        while True:
            await asyncio.sleep(LOAD_POLL_S)
            try:
                await self.poll_loads()
            except Exception:
                logger.exception("polling the engines' loads failed")

    def upstream(self, url: str) -> Upstream | None:
        return next((u for u in self.admission.upstreams if u.url == url), None)

    def apply_settings(self, policy: Policy) -> None:
        """A reloaded policy's admission and breaker settings, applied in place."""
        a, b = policy.admission, policy.breaker
        self.admission.reconfigure(
            a.max_inflight_per_upstream, a.max_queue, a.queue_timeout_s, a.spill_at, a.load_source, a.balance_factor
        )
        for upstream in self.admission.upstreams:
            upstream.breaker.reconfigure(b.failure_threshold, b.open_seconds, b.half_open_probes)
        self.prefix.configure(a.prefix, a.session_key)

    # ---- operator overrides ----

    def apply_overrides(self) -> None:
        """Drain exactly the upstreams the operators' overrides name."""
        self.admission.set_drained(self.overrides.drained())

    async def clear_overrides(self) -> None:
        """Lift every override (POST /admin/reload, POST /admin/overrides/clear, --clear-overrides)."""
        try:
            await self.overrides.clear()
        except Exception as exc:  # Redis down: lifted here; the shared ones stay until it is back
            logger.warning("could not clear the shared overrides: %s", exc)
        self.apply_overrides()

    async def sync_overrides(self) -> None:
        """Read the fleet's overrides (raises while the shared store is unreachable); a breaker reset sent
        to another replica resets ours too."""
        for url in await self.overrides.sync():
            upstream = self.upstream(url)
            if upstream is not None and upstream.breaker.reset():
                logger.info("breaker of %s reset by an operator (through another replica)", url)

    # ---- what they serve ----

    async def served_adapters(self) -> frozenset[str]:
        """The adapter ids the upstreams serve (empty when none has answered yet)."""
        return (await self.catalog.models()).adapters

    def unable(self, adapter: str | None, catalog: bool, mix: bool = False) -> frozenset[str]:
        """The upstreams that cannot serve `adapter`: for a mix of adapters, every vLLM engine (only loragate
        engines build one); for a catalog adapter, the vLLM engines without an agent to load it
        (gateway/vllm.py) that do not list it already."""
        if mix:
            return frozenset(u.url for u in self.admission.upstreams if u.kind is EngineKind.VLLM)
        if adapter is None or not catalog:
            return frozenset()
        return frozenset(
            u.url
            for u in self.admission.upstreams
            if u.kind is EngineKind.VLLM and u.agent is None and adapter not in u.serves
        )

    def all_vllm(self) -> bool:
        """Whether there are upstreams and all are vLLM engines: none of them can serve a mix of adapters."""
        upstreams = self.admission.upstreams
        return bool(upstreams) and all(u.kind is EngineKind.VLLM for u in upstreams)

    def base_name(self, named: str | None) -> str:
        """The base model a request without an adapter is served by (the one it named, if several)."""
        bases = self.catalog.cached().bases
        if named in bases:
            return named
        return min(bases) if bases else "base"

    # ---- state ----

    def drain(self) -> None:
        """Stop admitting (503 draining, /readyz 503); requests in flight finish."""
        self.draining = True
        self.admission.drain()

    def is_idle(self) -> bool:
        return sum(self.admission.inflight().values()) == 0

    @staticmethod
    def upstream_state(upstream: Upstream) -> dict[str, Any]:
        report = upstream.reported
        return {
            "url": upstream.url,
            "kind": upstream.kind.value,
            "agent": upstream.agent,
            "inflight": upstream.inflight,
            "load": upstream.load(time.monotonic()),
            "reported": {"running": report.running, "waiting": report.waiting} if report is not None else None,
            "breaker": upstream.breaker.state,
            "consecutive_failures": upstream.breaker.consecutive_failures,
            "drained": upstream.drained,
            "kv_cache_usage": upstream.kv_cache_usage,
        }

    def routing(self) -> dict[str, Any]:
        """For GET /admin/policy: each upstream's load, breaker and drain, each known adapter's preferred
        upstream."""
        upstreams = [self.upstream_state(u) for u in self.admission.upstreams]
        affinity = {}
        if self.store.active.policy.admission.affinity:
            affinity = {a: self.admission.preferred(a) for a in sorted(self.catalog.cached().adapters)}
        return {
            "upstreams": upstreams,
            "affinity": affinity,
            "spill_inflight": self.admission.spill_inflight,
            "spills": self.admission.spills,
            "prefix": self.prefix.describe(),
        }
