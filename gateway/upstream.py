"""The engine replicas behind the gateway: one pooled HTTP client, and what models they serve.

`UpstreamCatalog.adapters()` is the union of the model ids (base models and adapters) that the healthy
upstreams list on GET /v1/models; each upstream's own list is kept too (`Upstream.serves`). It is cached for
`CATALOG_TTL_S`, so a request costs no extra round trip; a refresh that fails everywhere keeps the last good answer
(an unreachable replica should not make every adapter a 404 — admission answers for it instead).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from gateway.admission import Upstream

logger = logging.getLogger(__name__)

CATALOG_TTL_S = 5.0
CONNECT_TIMEOUT_S = 2.0
DEFAULT_READ_TIMEOUT_S = 300.0  # the longest gap between two bytes of an upstream answer


def make_client(
    max_inflight_per_upstream: int, num_upstreams: int, read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
) -> httpx.AsyncClient:
    """One pooled client for every upstream.

    The number of connections is not capped here: admission already bounds the requests in flight, and
    a policy reload may raise that bound. Enough of them are kept alive for every admitted request.
    """
    per_upstream = max_inflight_per_upstream + 4  # + catalog refreshes and a retry's overlap
    # With discovered engines the count changes: keep room for a few more than there are at start.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=per_upstream * max(num_upstreams, 4))
    timeout = httpx.Timeout(read_timeout_s, connect=CONNECT_TIMEOUT_S, pool=CONNECT_TIMEOUT_S)
    return httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False)


@dataclass(frozen=True, slots=True)
class Models:
    """What the upstreams serve: base model ids, and adapter ids with the base each sits on."""

    bases: frozenset[str]
    adapters: frozenset[str]

    @property
    def all(self) -> frozenset[str]:
        return self.bases | self.adapters


_EMPTY = Models(frozenset(), frozenset())


class UpstreamCatalog:
    def __init__(
        self,
        upstreams: Callable[[], list[Upstream]],
        client: httpx.AsyncClient,
        clock: Callable[[], float] = time.monotonic,
        ttl_s: float = CATALOG_TTL_S,
    ) -> None:
        """`upstreams()`: the current upstreams (they change when engines are discovered)."""
        self.upstreams = upstreams
        self.client = client
        self._clock = clock
        self._ttl_s = ttl_s
        self._models = _EMPTY
        self._fetched_at: float | None = None
        self._lock = asyncio.Lock()

    async def models(self) -> Models:
        if self._fresh():
            return self._models
        async with self._lock:  # one refresh at a time; the others wait for its answer
            if not self._fresh():
                await self._refresh()
        return self._models

    async def adapters(self) -> set[str]:
        """Every id a request may name: the adapters and the base model(s)."""
        return set((await self.models()).all)

    async def base_models(self) -> set[str]:
        return set((await self.models()).bases)

    def cached(self) -> Models:
        """The last answer, without refreshing."""
        return self._models

    def invalidate(self) -> None:
        self._fetched_at = None

    def _fresh(self) -> bool:
        return self._fetched_at is not None and self._clock() - self._fetched_at < self._ttl_s

    async def _refresh(self) -> None:
        upstreams = self.upstreams()
        healthy = [u for u in upstreams if u.breaker.state != "open"] or upstreams
        answers = await asyncio.gather(*(self._fetch(u.url) for u in healthy))
        for upstream, answer in zip(healthy, answers, strict=True):
            if answer is not None:  # what each one lists (gateway/vllm.py: whether its agent must load an adapter)
                upstream.serves = answer.adapters
        good = [a for a in answers if a is not None]
        # After a failure everywhere, look again in a second instead of a whole TTL.
        self._fetched_at = self._clock() - (0.0 if good else max(0.0, self._ttl_s - 1.0))
        if good:
            self._models = Models(
                frozenset().union(*(m.bases for m in good)), frozenset().union(*(m.adapters for m in good))
            )

    async def _fetch(self, url: str) -> Models | None:
        try:
            resp = await self.client.get(f"{url}/v1/models", timeout=CONNECT_TIMEOUT_S)
            resp.raise_for_status()
            cards = resp.json()["data"]
            bases = frozenset(c["id"] for c in cards if not c.get("parent"))
            adapters = frozenset(c["id"] for c in cards if c.get("parent"))
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            logger.warning("GET %s/v1/models failed: %s", url, exc)
            return None
        return Models(bases, adapters)
