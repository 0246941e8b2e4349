"""Admission: a bounded number of requests in flight per upstream, a priority queue for the rest.

`AdmissionController.acquire(priority, tenant, exclude, affinity)` returns a `Slot` on an upstream or
raises `Shed`:
- An upstream can take a request when it is not in `exclude`, not drained by an operator (`set_drained`:
  it takes no new request, those in flight finish), its breaker allows it and fewer than
  `max_inflight_per_upstream` requests are in flight on it.
- An upstream's load is what it reports of itself (`EngineLoad`: its running and waiting requests, from
  every gateway replica, read from the `X-Loragate-Load` header of its answers and from GET /load about
  once a second) while that report is fresh, and never less than this replica's own requests in flight
  on it; with `load_source: local` (the policy's `admission`), only the latter, as before engines reported.
- Without an affinity key (a base-model request) the least loaded of those is chosen (ties rotate).
- With an affinity key (an adapter id) the upstreams are ranked by rendezvous (highest-random-weight)
  hashing of (key, url), so each adapter has a stable preferred replica that keeps it loaded and warm
  instead of every replica paging it in. The first upstream in that order that can take the request and
  has fewer than `spill_inflight` in flight gets it; when every one that can take it is at or above
  `spill_inflight`, the request spills to the least loaded of them (ties in rendezvous order), trading a
  cold adapter load for not piling onto one hot replica. With engine-reported loads, an upstream is also
  too busy for affinity when its load would pass `balance_factor` times the fleet's mean (consistent
  hashing with bounded loads, Mirrokni et al. 2018), so replicas whose requests pile onto one engine see
  it and spread, while each adapter keeps one preferred engine; a spill then prefers an engine that
  reports the adapter on its device. Engines also report how many adapters their device holds: an adapter
  (unless hot) resident nowhere goes to the first engine in its order with a free device slot, and one
  resident elsewhere than its preferred engine stays there (`_home`), so adapters are placed where loading
  them evicts nothing. `spills` counts requests that did not get their
  first healthy choice because it was that busy. An upstream whose breaker is open is skipped, so its
  adapters move to their next choice and come back when it recovers; removing an upstream remaps only the
  adapters it was first choice for (`rendezvous_order` is the pure ranking, shared with admin views).
- Hints (gateway/prefix_index.py) name the upstreams that hold the request's prompt prefix (how many leading
  chunks each) and its session's upstream. Those within the load bound (with engine-reported loads: load + 1
  at most `balance_factor` x the mean, never below MIN_BOUND, and fewer than `spill_inflight` of ours there;
  with local loads: fewer than `spill_inflight`) go first, the longest match first, then the session's; the
  order above breaks ties. So a conversation returns to the engine that holds it until that engine is past
  the bound, and a hot prefix spreads like a hot adapter.
- Otherwise the request waits in one of three bands (critical, standard, sheddable). Within a band the
  tenants take turns (round-robin over tenants that have someone waiting, FIFO within a tenant), so a
  tenant with 100 queued cannot starve one with 1. Whenever a slot is released or a breaker changes
  state, the best waiter that some upstream has room for gets the slot.
- The queue holds at most `max_queue` waiters. When it is full, the newest waiter of the lowest non-empty
  band is shed (`queue_full`) if that band is lower than the arrival; otherwise the arrival is shed.
- A waiter gives up after `queue_timeout_s` (`queue_timeout`); a cancelled waiter (client gone) leaves
  the queue at once.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

from gateway.breaker import CircuitBreaker
from gateway.engine_kinds import EngineKind
from gateway.prefix_index import NO_HINTS, Hints
from loragate_common.priority import Priority

BAND_NAMES = ("critical", "standard", "sheddable")  # indexed by Priority
QUEUE_RETRY_AFTER_S = 1.0  # Retry-After for queue_full / queue_timeout / draining / no_upstream

_MESSAGES = {
    "queue_full": "the gateway's admission queue is full",
    "queue_timeout": "the request waited too long for a free upstream slot",
    "draining": "the gateway is draining and takes no new requests",
    "circuit_open": "every upstream's circuit breaker is open",
    "no_upstream": "no upstream is available for this request",
}


def rendezvous_score(key: str, url: str) -> int:
    """The weight of `url` for `key`: stable across processes and hosts (unlike `hash()`, which is salted).

    The key is length-prefixed so that ("ab", "c") and ("a", "bc") hash different bytes.
    """
    raw = key.encode()
    digest = hashlib.blake2b(len(raw).to_bytes(4, "big") + raw + url.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _rank(key: str, url: str) -> tuple[int, str]:
    return rendezvous_score(key, url), url  # the url breaks (vanishingly rare) score ties deterministically


def rendezvous_order(key: str, urls: Sequence[str]) -> list[str]:
    """`urls` from most to least preferred for `key` (highest score first).

    Each url's score depends only on (key, url), so removing a url changes the first choice only of the
    keys it was first for, and adding one moves only the keys that now score it highest.
    """
    return sorted(urls, key=lambda url: _rank(key, url), reverse=True)


class Shed(Exception):
    """A request refused by admission; the app answers 503 with Retry-After and X-Loragate-Reason."""

    status = 503

    def __init__(self, reason: str, retry_after_s: float = QUEUE_RETRY_AFTER_S) -> None:
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.message = _MESSAGES.get(reason, reason)
        super().__init__(f"{reason}: {self.message}")


MIN_BOUND = 2  # the bounded-load rule's smallest bound: below it affinity always holds
COLD_SPILL = 1.5  # how far past the bound a cold adapter's request waits before moving to where it is not
RECENT = 256  # the adapter requests this replica admitted last, whose shares say which adapters are hot
LOAD_FRESH_S = 3.0  # an engine's report older than this is ignored (this replica's in-flight count only)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What an engine reports of itself: requests running and waiting there, from every gateway replica."""

    running: int
    waiting: int
    at: float  # time.monotonic() when it was received

    @classmethod
    def parse(cls, header: str, at: float) -> EngineLoad | None:
        """The `X-Loragate-Load` header (`running=3, waiting=1, ...`; unknown fields ignored), or None."""
        fields: dict[str, int] = {}
        for part in header.split(","):
            name, _, value = part.strip().partition("=")
            if value.isdigit():
                fields[name] = int(value)
        if "running" not in fields or "waiting" not in fields:
            return None
        return cls(fields["running"], fields["waiting"], at)


@dataclass(eq=False, slots=True)
class Upstream:
    url: str
    breaker: CircuitBreaker
    kind: EngineKind = EngineKind.LORAGATE  # what it is and how it reports (gateway/engine_kinds.py)
    agent: str | None = None  # a vLLM engine's `loragate vllm-agent` base URL (gateway/vllm.py)
    inflight: int = 0
    drained: bool = False  # an operator's drain: no new requests (gateway/overrides.py)
    reported: EngineLoad | None = None  # its last report (gateway/fleet.py polls it; answers carry it too)
    on_device: frozenset[str] = frozenset()  # adapters it last reported resident on its device
    device_slots: int | None = None  # how many adapters its device holds at once (None: not reported)
    serves: frozenset[str] = frozenset()  # the adapters its /v1/models last listed (gateway/upstream.py)
    kv_cache_usage: float | None = None  # a vLLM engine's KV cache use, 0-1, as it last reported it

    def load(self, now: float) -> int:
        """Requests on it as best known: its fresh report, never less than ours in flight there."""
        report = self.reported
        if report is None or now - report.at > LOAD_FRESH_S:
            return self.inflight
        return max(self.inflight, report.running + report.waiting)

    def finished(self, since: float) -> None:
        """One of our requests there, sent at `since` (time.monotonic()), has ended: a report received after
        that counted it (the engine's answer to it carried one), so it counts one request fewer until the next
        report. Without this, a conversation's next turn, sent the moment the last one ends, would find its
        engine one request busier than it is, and the load bound would move it for nothing."""
        report = self.reported
        if report is None or report.at < since:
            return
        if report.running:
            self.reported = EngineLoad(report.running - 1, report.waiting, report.at)
        elif report.waiting:
            self.reported = EngineLoad(0, report.waiting - 1, report.at)

    def has_free_slot(self) -> bool:
        """Whether it can load one more adapter without evicting another, as far as it reported."""
        return self.device_slots is None or len(self.on_device) < self.device_slots

    def can_allow(self) -> bool:
        """Whether it may take a request now, room aside (without taking a half-open probe place)."""
        return not self.drained and self.breaker.can_allow()


class Slot:
    """The right to send one request to `upstream`. `release()` is idempotent and wakes the next waiter."""

    __slots__ = ("upstream", "wait_s", "_controller", "_released", "_granted_at")

    def __init__(self, upstream: Upstream, controller: AdmissionController, wait_s: float) -> None:
        self.upstream = upstream
        self.wait_s = wait_s  # seconds spent queued (0 when admitted at once)
        self._controller = controller
        self._released = False
        self._granted_at = controller._clock()  # the clock reports are stamped with (EngineLoad.at)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.upstream.inflight -= 1
        self.upstream.finished(self._granted_at)
        self._controller._dispatch()


@dataclass(eq=False, slots=True)
class _Waiter:
    priority: Priority
    tenant: str
    exclude: frozenset[str]
    affinity: str | None
    hints: Hints
    seq: int
    enqueued_at: float
    future: asyncio.Future[Slot]


@dataclass(slots=True)
class _Band:
    """One priority band: tenants in turn order, each with its FIFO of waiters."""

    order: deque[str] = field(default_factory=deque)  # tenants with someone waiting; next turn first
    queues: dict[str, deque[_Waiter]] = field(default_factory=dict)

    def add(self, waiter: _Waiter) -> None:
        if waiter.tenant not in self.queues:
            self.queues[waiter.tenant] = deque()
            self.order.append(waiter.tenant)
        self.queues[waiter.tenant].append(waiter)

    def remove(self, waiter: _Waiter) -> None:
        queue = self.queues[waiter.tenant]
        queue.remove(waiter)
        if not queue:
            del self.queues[waiter.tenant]
            self.order.remove(waiter.tenant)

    def served(self, waiter: _Waiter) -> None:
        """Remove a waiter that got a slot; its tenant's next turn comes after every other tenant's."""
        self.remove(waiter)
        if waiter.tenant in self.queues:
            self.order.remove(waiter.tenant)
            self.order.append(waiter.tenant)

    def newest(self) -> _Waiter | None:
        tails = [queue[-1] for queue in self.queues.values()]
        return max(tails, key=lambda w: w.seq, default=None)

    def in_turn_order(self) -> Iterator[_Waiter]:
        """Waiters in serving order; stop iterating before changing the band."""
        for tenant in self.order:
            yield from self.queues[tenant]


class AdmissionController:
    def __init__(
        self,
        upstreams: list[Upstream],
        max_inflight_per_upstream: int,
        max_queue: int,
        queue_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        spill_inflight: int | None = None,
        load_source: str = "local",
        balance_factor: float = 1.2,
    ) -> None:
        self.upstreams = list(upstreams)
        self.load_source = load_source  # "engine": reported loads and bounded-load affinity; "local": ours only
        self.balance_factor = balance_factor
        self.retiring: list[Upstream] = []  # removed by set_upstreams, requests still in flight on them
        self.spills = 0  # affinity requests sent past a busy first choice (exported as a metric)
        self._recent: deque[str] = deque()  # the last RECENT affinity keys admitted here
        self._recent_counts: collections.Counter[str] = collections.Counter()
        self._set_limits(max_inflight_per_upstream, max_queue, queue_timeout_s, spill_inflight)
        self._clock = clock
        self._bands = [_Band() for _ in Priority]
        self._depths = [0 for _ in Priority]  # waiters per band; each queued waiter's future is pending
        self._seq = itertools.count()
        self._rotation = 0  # rotates ties between equally loaded upstreams
        self._draining = False
        self._wakeup: asyncio.TimerHandle | None = None  # re-dispatch when an open breaker turns half-open
        for upstream in self.upstreams:
            upstream.breaker.subscribe(self._dispatch)

    def _set_limits(
        self, max_inflight_per_upstream: int, max_queue: int, queue_timeout_s: float, spill_inflight: int | None
    ) -> None:
        assert max_inflight_per_upstream >= 1 and max_queue >= 0 and queue_timeout_s > 0
        assert spill_inflight is None or spill_inflight >= 1
        self.max_inflight_per_upstream = max_inflight_per_upstream
        if spill_inflight is None:
            spill_inflight = max(1, max_inflight_per_upstream * 3 // 4)
        self.spill_inflight = min(spill_inflight, max_inflight_per_upstream)
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s

    def reconfigure(
        self,
        max_inflight_per_upstream: int,
        max_queue: int,
        queue_timeout_s: float,
        spill_inflight: int | None = None,
        load_source: str = "local",
        balance_factor: float = 1.2,
    ) -> None:
        """New limits (a policy reload). Requests in flight and waiters already queued keep what they have
        (a waiter's timeout was set when it arrived; a queue now over `max_queue` drains as slots free);
        new room is handed out at once."""
        self._set_limits(max_inflight_per_upstream, max_queue, queue_timeout_s, spill_inflight)
        self.load_source, self.balance_factor = load_source, balance_factor
        self._dispatch()

    def set_upstreams(self, upstreams: list[Upstream]) -> None:
        """A new set of upstreams (engines discovered or gone). A removed one gets no new request; those in
        flight on it finish (it is kept in `retiring`, counted in `inflight()`, until they have). Waiters
        may use new ones at once."""
        kept = set(map(id, upstreams))
        for upstream in self.upstreams:
            if id(upstream) not in kept:
                upstream.breaker.unsubscribe(self._dispatch)
                if upstream.inflight:
                    self.retiring.append(upstream)
        for upstream in upstreams:
            if upstream not in self.upstreams:
                upstream.breaker.subscribe(self._dispatch)
        self.upstreams = list(upstreams)
        self._dispatch()

    def set_drained(self, urls: Collection[str]) -> None:
        """Drain exactly these upstreams (an operator's action, gateway/overrides.py): no new requests for
        them, those in flight finish. Undrained ones take waiters at once."""
        changed = False
        for upstream in self.upstreams:
            drained = upstream.url in urls
            changed |= upstream.drained != drained
            upstream.drained = drained
        if changed:
            self._dispatch()

    @property
    def draining(self) -> bool:
        return self._draining

    async def acquire(
        self,
        priority: Priority,
        tenant: str,
        exclude: frozenset[str] = frozenset(),
        affinity: str | None = None,
        hints: Hints = NO_HINTS,
    ) -> Slot:
        """A slot for one request; `affinity` (an adapter id, None for the base model) and `hints` (the
        engines holding its prompt's prefix and its session, gateway/prefix_index.py) steer the choice."""
        if self._draining:
            raise Shed("draining")
        candidates = [u for u in self.upstreams if u.url not in exclude and not u.drained]
        if not candidates:
            raise Shed("no_upstream")
        if not any(u.breaker.can_allow() for u in candidates):
            raise Shed("circuit_open", min(u.breaker.retry_after_s() for u in candidates))
        if not any(self._depths[: priority + 1]):  # nobody at this priority or above is waiting
            upstream = self._pick(exclude, affinity, hints)
            if upstream is not None:
                return self._grant(upstream, 0.0, affinity)
        self._make_room(priority)
        future: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(priority, tenant, exclude, affinity, hints, next(self._seq), self._clock(), future)
        self._bands[priority].add(waiter)
        self._depths[priority] += 1
        self._dispatch()
        return await self._wait(waiter)

    def drain(self) -> None:
        """Refuse new requests and fail every queued one with `draining`; slots in flight finish."""
        self._draining = True
        for band in self._bands:
            for waiter in list(band.in_turn_order()):
                self._shed(waiter, Shed("draining"))

    def close(self) -> None:
        """Detach from the breakers (for a controller being replaced, e.g. on policy reload)."""
        for upstream in self.upstreams:
            upstream.breaker.unsubscribe(self._dispatch)
        if self._wakeup is not None:
            self._wakeup.cancel()
            self._wakeup = None

    def queue_depths(self) -> dict[str, int]:
        return dict(zip(BAND_NAMES, self._depths, strict=True))

    def inflight(self) -> dict[str, int]:
        """Requests in flight per upstream URL, those on retiring upstreams included."""
        self.retiring = [u for u in self.retiring if u.inflight]
        counts = {u.url: u.inflight for u in self.retiring}
        counts.update((u.url, u.inflight + counts.get(u.url, 0)) for u in self.upstreams)
        return counts

    def preferred(self, affinity: str) -> str | None:
        """Where `affinity` goes when load is not a concern: its first healthy rendezvous choice, if any."""
        for upstream in self._rendezvous(affinity):
            if upstream.can_allow():
                return upstream.url
        return None

    async def _wait(self, waiter: _Waiter) -> Slot:
        # A timer sheds the waiter on timeout, not asyncio.wait_for: on Python 3.11 wait_for swallows a
        # cancellation that lands in the tick the slot is granted (gh-86296). One of grant/shed settles it.
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.queue_timeout_s, self._shed, waiter, Shed("queue_timeout"))
        try:
            return await waiter.future
        except BaseException:
            self._remove(waiter)
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().release()  # granted, but the caller was cancelled (client gone)
            raise
        finally:
            timer.cancel()

    def _pick(self, exclude: frozenset[str], affinity: str | None = None, hints: Hints = NO_HINTS) -> Upstream | None:
        """An upstream with room whose breaker allows a request (taking a probe place, if half-open).

        Whether one is found depends only on `exclude`, never on `affinity` or `hints`: spill lets an
        affinity request use any upstream with room, just as a base-model request can, and hints only
        reorder the upstreams with room.
        """
        if affinity is None:
            return self._pick_least_loaded(exclude, hints)
        return self._pick_affine(exclude, affinity, hints)

    def _load(self, upstream: Upstream) -> int:
        return upstream.load(self._clock()) if self.load_source == "engine" else upstream.inflight

    def _pick_least_loaded(self, exclude: frozenset[str], hints: Hints = NO_HINTS) -> Upstream | None:
        """The least loaded upstream with room whose breaker allows a request (after those within the load
        bound that hold the request's prefix or session)."""
        n = len(self.upstreams)
        loads = {id(u): self._load(u) for u in self.upstreams}
        order = sorted(range(n), key=lambda i: (loads[id(self.upstreams[i])], (i - self._rotation) % n))
        candidates = [
            u
            for u in (self.upstreams[i] for i in order)
            if u.url not in exclude and not u.drained and u.inflight < self.max_inflight_per_upstream
        ]
        if hints is not NO_HINTS and candidates:
            bound = self._bound(sum(loads[id(u)] for u in candidates), len(candidates))
            candidates, _ = _held_first(candidates, hints, lambda u: self._within(u, loads[id(u)], bound))
        for upstream in candidates:
            if upstream.breaker.allow():
                self._rotation += 1
                return upstream
        return None

    def _bound(self, total_load: int, upstreams: int) -> int:
        """The bounded-load rule's bound: with this request, no upstream above balance_factor x the mean
        (never below MIN_BOUND, so light traffic keeps every request where it prefers)."""
        return max(MIN_BOUND, math.ceil(self.balance_factor * (total_load + 1) / max(1, upstreams)))

    def _within(self, upstream: Upstream, load: int, bound: int) -> bool:
        """Whether one more request keeps `upstream` within the load bound (with local loads: below
        `spill_inflight` of this replica's requests; spill_inflight stays a bound on them either way)."""
        if self.load_source == "engine":
            return upstream.inflight < self.spill_inflight and load + 1 <= bound
        return upstream.inflight < self.spill_inflight

    def _pick_affine(self, exclude: frozenset[str], affinity: str, hints: Hints = NO_HINTS) -> Upstream | None:
        """The first calm upstream (below `spill_inflight`) in `affinity`'s rendezvous order, else the
        least loaded one with room.

        Breakers are only asked `can_allow()` while ranking: `allow()` takes a half-open probe place, so it
        is called on the upstream actually chosen.
        """
        healthy = [u for u in self._rendezvous(affinity) if u.url not in exclude and u.can_allow()]
        roomy = [u for u in healthy if u.inflight < self.max_inflight_per_upstream]
        loads = {id(u): self._load(u) for u in roomy}
        bound = self._bound(sum(loads.values()), len(roomy))

        def fits(u: Upstream, limit: int = bound) -> bool:
            return self._within(u, loads[id(u)], limit)

        if self.load_source == "engine":
            # Bounded loads: with this request, no upstream above balance_factor x the mean (never below
            # MIN_BOUND, so light traffic keeps every adapter on its preferred upstream). Moving a request
            # to an upstream without the adapter on its device costs a load there and may evict another
            # adapter: worth it for a hot adapter (`_is_hot`: it will stay resident there and take its share),
            # not for a cold one, which moves only to an upstream that has it, or past COLD_SPILL x the bound.
            cold_bound = max(bound, math.ceil(COLD_SPILL * bound))
            hot = self._is_hot(affinity, len(roomy))
            home = self._home(affinity, healthy)
            warm = [u for u in roomy if fits(u) and (hot or u in home)]
            calm = warm + [u for u in roomy if u not in warm and fits(u, cold_bound)]
            busy = sorted(
                (u for u in roomy if u not in calm), key=lambda u: (affinity not in u.on_device, loads[id(u)])
            )
        else:
            calm = [u for u in roomy if u.inflight < self.spill_inflight]
            busy = sorted((u for u in roomy if u.inflight >= self.spill_inflight), key=lambda u: u.inflight)
        # sorted() is stable: equally loaded busy ones stay in rendezvous order
        order, held = _held_first(calm + busy, hints, fits)
        for upstream in order:
            if upstream.breaker.allow():
                if upstream is not healthy[0] and upstream not in held:
                    self.spills += 1  # the first healthy choice was at or above spill_inflight
                return upstream
        return None

    @staticmethod
    def _home(affinity: str, healthy: list[Upstream]) -> list[Upstream]:
        """Where a cold adapter runs without costing a load that evicts another: the upstreams that report it
        on their device; where none does, the first in its rendezvous order with a free device slot (its
        preferred one, unless that one's device is full of other adapters), else its preferred one. So an
        adapter moved by a spill stays where it went once its preferred upstream has evicted it, and a fleet
        whose adapters hash unevenly fills every device before any evicts."""
        resident = [u for u in healthy if affinity in u.on_device]
        return resident or next(([u] for u in healthy if u.has_free_slot()), healthy[:1])

    def _rendezvous(self, affinity: str) -> list[Upstream]:
        """The upstreams in `affinity`'s rendezvous order (the ranking `rendezvous_order` gives urls)."""
        return sorted(self.upstreams, key=lambda u: _rank(affinity, u.url), reverse=True)

    def _grant(self, upstream: Upstream, wait_s: float, affinity: str | None = None) -> Slot:
        upstream.inflight += 1
        if affinity is not None:
            if (
                self.load_source == "engine"
                and upstream.device_slots is not None
                and affinity not in upstream.on_device
            ):
                # It will be loaded there: counted as resident until the engine's next report says otherwise,
                # so the next requests for it (and for adapters looking for a free slot) see it now. Only on an
                # engine that reports its device: on another, the guess would never be corrected.
                upstream.on_device |= {affinity}
            self._recent.append(affinity)
            self._recent_counts[affinity] += 1
            if len(self._recent) > RECENT:
                gone = self._recent.popleft()
                self._recent_counts[gone] -= 1
                if not self._recent_counts[gone]:
                    del self._recent_counts[gone]
        return Slot(upstream, self, wait_s)

    def _is_hot(self, affinity: str, upstreams: int) -> bool:
        """Whether `affinity` carries so much of this replica's recent traffic (1 / (2 x upstreams) of it, a
        quarter with two) that one engine cannot take its share alone: then a copy on a second engine pays
        for its load. Rarer adapters would each cost a load for a handful of requests."""
        return len(self._recent) >= 64 and self._recent_counts[affinity] * 2 * upstreams >= len(self._recent)

    def _make_room(self, priority: Priority) -> None:
        """Ensure the queue can take one more waiter of `priority`, or raise Shed(queue_full)."""
        if sum(self._depths) < self.max_queue:
            return
        for band_priority in reversed(Priority):
            if band_priority <= priority:
                break
            victim = self._bands[band_priority].newest()
            if victim is not None:
                self._shed(victim, Shed("queue_full"))
                return
        raise Shed("queue_full")

    def _remove(self, waiter: _Waiter) -> None:
        """Take a waiter out of the queue if it is still there (idempotent)."""
        band = self._bands[waiter.priority]
        if waiter in band.queues.get(waiter.tenant, ()):
            band.remove(waiter)
            self._depths[waiter.priority] -= 1

    def _shed(self, waiter: _Waiter, error: Shed) -> None:
        self._remove(waiter)
        if not waiter.future.done():
            waiter.future.set_exception(error)

    def _dispatch(self) -> None:
        """Hand free slots to the best waiters: band by band, tenants in turn, FIFO within a tenant."""
        while any(self._depths) and self._grant_one():
            pass
        if any(self._depths):
            self._schedule_wakeup()

    def _grant_one(self) -> bool:
        """Give one slot to the first waiter in priority and turn order that an upstream has room for."""
        cap = self.max_inflight_per_upstream
        if not any(u.inflight < cap and u.can_allow() for u in self.upstreams):
            return False  # fast path: nothing is free
        # Exclude sets no upstream can serve right now. Keyed by exclude alone: whether `_pick` finds an
        # upstream does not depend on the affinity (it only orders the upstreams with room), so a refusal
        # holds for every waiter with the same exclude set, whatever adapter it asks for.
        refused: set[frozenset[str]] = set()
        for priority, band in zip(Priority, self._bands, strict=True):
            for waiter in band.in_turn_order():
                if waiter.exclude in refused:
                    continue
                upstream = self._pick(waiter.exclude, waiter.affinity, waiter.hints)
                if upstream is None:
                    refused.add(waiter.exclude)
                    continue
                band.served(waiter)
                self._depths[priority] -= 1
                waiter.future.set_result(self._grant(upstream, self._clock() - waiter.enqueued_at, waiter.affinity))
                return True
        return False

    def _schedule_wakeup(self) -> None:
        """Waiters are left and some breaker is open: look again when the soonest turns half-open."""
        if self._wakeup is not None:
            return
        delays = [u.breaker.retry_after_s() for u in self.upstreams if u.breaker.state == "open"]
        if not delays:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._wakeup = loop.call_later(min(delays), self._on_wakeup)

    def _on_wakeup(self) -> None:
        self._wakeup = None
        self._dispatch()


def _held_first(
    order: list[Upstream], hints: Hints, within: Callable[[Upstream], bool]
) -> tuple[list[Upstream], list[Upstream]]:
    """`order` with the upstreams within the load bound that hold the request's prefix or its session moved
    ahead: the longest prefix match first, then the session's upstream; `order` breaks ties (adapter affinity,
    load). Returns the new order and the upstreams moved ahead."""
    if not hints.matches and hints.session is None:
        return order, []
    held = [u for u in order if (hints.match(u.url) or u.url == hints.session) and within(u)]
    held.sort(key=lambda u: (-hints.match(u.url), u.url != hints.session))
    return held + [u for u in order if u not in held], held
