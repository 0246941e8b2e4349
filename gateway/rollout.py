"""Rollouts: sticky canary / A-B splits of one adapter name over several adapters, with automatic rollback.

Routing (`Rollouts.route`): a request that names a rollout gets one of its variants.
- Sticky split: blake2b(rollout name, sticky value) into `BUCKETS` buckets, walked against the
  cumulative weights, so every gateway replica (and every restart) sends the same user to the same
  variant, and a weight change moves only the users whose bucket changes hands. The sticky value is
  the tenant id (`sticky_key: tenant`) or a request header (`header:NAME`); a request without that
  header falls back to its tenant id, so one tenant's header-less traffic stays on one variant.
- Override: the rollout's `override_header` may name one of its adapters to force that variant, when
  the tenant's `adapters` globs allow that adapter itself (403 otherwise; 400 when it names no variant).
  An override is honoured even after a rollback: it is an explicit, permitted ask.
- Rollback: once rolled back, a rollout serves its first variant to everyone.
- Control (gateway/progress.py): a progressive rollout's split is its current step's weight; a promoted
  rollout serves its last variant to everyone. Operators pause, resume, promote, roll back and reset a
  rollout (`Rollouts.act`, POST /admin/rollouts/{name}/{action}).

Health (`Rollouts.record`, gateway/rollback.py): every request that reached an upstream is recorded against
its variant in a sliding window of `rollback.window_s` (the app decides what is an error: an engine's 5xx
other than 503, an upstream failure, a broken stream). When a variant other than the first has at least `min_requests`
in its window and its error rate exceeds `max_error_rate`, or the p99 of its time to first token
exceeds `max_ttft_p99_ms`, the rollout is rolled back: logged, counted, shown in GET /admin/policy.
It stays rolled back until the policy is reloaded with POST /admin/reload; a file-change reload that
leaves the rollout's definition unchanged keeps its state (windows and rollback), a changed definition
starts afresh.

Sharing (gateway/fleet_store.py), with Redis, at each `Rollouts.sync` (about once a second):
- Pooled windows: each replica adds its outcomes (`Counts`: requests, errors, and how many TTFTs were
  above the bound, which is all a p99 test needs) to per-variant hashes in time slices of
  window_s / SLICES, and judges the sum of the slices in the window, so `min_requests` counts the
  whole fleet's requests. Its own window is judged too, at once, on every request.
- Rollbacks: a rollback is written to a key named after the rollout and a hash of its definition, and
  every replica adopts the keys it finds, so all replicas roll back together. One decided while Redis
  is unreachable is kept locally (and its counts kept for pooling) until Redis is back.
- Control states: one key per rollout definition, the newest version wins (gateway/progress.py), so every
  replica serves the same step and a restarted one resumes it; a key that vanished (another replica's
  POST /admin/reload) sends the rollout back to its first step.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from gateway.fleet_store import FleetStore, LocalFleetStore
from gateway.policy import Rollout, Tenant, Variant
from gateway.progress import PAUSED, PROGRESSING, PROMOTED, Control, effective_weights, next_step
from gateway.rollback import Counts, RollbackEvent, Window, verdict
from loragate_common.errors import ApiError, shown

logger = logging.getLogger(__name__)

BUCKETS = 10_000


def bucket(rollout: str, sticky: str) -> int:
    """The bucket (0..BUCKETS-1) of a sticky value in a rollout: a stable hash, the same in every process."""
    data = f"{rollout}\x00{sticky}".encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") % BUCKETS


def bucket_bounds(variants: Iterable[Variant], weights: list[float] | None = None) -> list[int]:
    """The exclusive upper bucket of each variant: cumulative weights (the variants' own, or `weights`)
    scaled to BUCKETS."""
    weights = weights if weights is not None else [v.weight for v in variants]
    total = sum(weights)
    bounds, running = [], 0.0
    for w in weights:
        running += w
        bounds.append(round(running / total * BUCKETS))
    bounds[-1] = BUCKETS
    return bounds


def pick_variant(rollout: Rollout, sticky: str, weights: list[float] | None = None) -> Variant:
    """The variant a sticky value lands on: the first whose bound lies above its bucket (with the
    rollout's weights, or `weights`: a progressive rollout's current step)."""
    b = bucket(rollout.name, sticky)
    bounds = bucket_bounds(rollout.variants, weights)
    return rollout.variants[bisect.bisect_right(bounds, b)]


def sticky_value(rollout: Rollout, tenant: Tenant, header: Callable[[str], str | None]) -> str:
    """The value a request is split by: its sticky header, or the tenant id (sticky_key tenant, or no header)."""
    if rollout.sticky_key.startswith("header:"):
        value = (header(rollout.sticky_key[7:]) or "").strip()
        if value:
            return value
    return tenant.id


def definition_hash(rollout: Rollout) -> str:
    """A short hash of a rollout's definition: state carries over a reload only while this is unchanged."""
    text = json.dumps(rollout.model_dump(mode="json"), sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


@dataclass(eq=False)
class RolloutState:
    """One rollout's health: a window per variant, and the rollback once decided."""

    rollout: Rollout
    key: str  # the shared key: name + definition hash
    windows: dict[str, Window] = field(default_factory=dict)
    rolled_back: RollbackEvent | None = None
    published: bool = True  # False: decided here, not yet written to the shared store
    fleet: dict[str, Counts] = field(default_factory=dict)  # the pooled windows, as last read (shared only)
    control: Control = field(default_factory=Control)  # step, pause, promotion (gateway/progress.py)
    control_dirty: bool = False  # changed here, not yet written to the shared store

    def __post_init__(self) -> None:
        span = self.rollout.rollback.window_s if self.rollout.rollback is not None else 60.0
        self.windows = {v.adapter: Window(span) for v in self.rollout.variants}

    @property
    def control_key(self) -> str:
        return self.key.replace(Rollouts.SHARE_PREFIX, Rollouts.CONTROL_PREFIX, 1)

    def set_control(self, control: Control) -> None:
        self.control = control
        self.control_dirty = True
        logger.info("rollout %r: %s (by %s)", self.rollout.name, control.decision, control.by)

    def current_weights(self) -> list[float]:
        """The percent of traffic each variant gets now: all to the first while rolled back, else the
        step's or the policy's split (gateway/progress.py)."""
        if self.rolled_back is not None:
            return [100.0] + [0.0] * (len(self.rollout.variants) - 1)
        weights = effective_weights(self.rollout, self.control)
        total = sum(weights) or 1.0
        return [100 * w / total for w in weights]

    def check(self, variant: str, now: float, wall: float) -> RollbackEvent | None:
        """The rollback this replica's window of `variant` calls for, if any (never for the first variant)."""
        bounds = self.rollout.rollback
        if bounds is None or self.rolled_back is not None or variant == self.rollout.variants[0].adapter:
            return None
        return verdict(bounds, variant, self.windows[variant].counts(now, bounds.max_ttft_p99_ms), wall)

    def describe(self, now: float) -> dict[str, Any]:
        variants = []
        for v in self.rollout.variants:
            n, errors, p99 = self.windows[v.adapter].stats(now)
            entry: dict[str, Any] = {
                "adapter": v.adapter,
                "weight": v.weight,
                "window": {
                    "requests": n,
                    "errors": errors,
                    "error_rate": round(errors / n, 4) if n else None,
                    "ttft_p99_ms": round(p99 * 1000, 1) if p99 is not None else None,
                },
            }
            fleet = self.fleet.get(v.adapter)
            if fleet is not None:
                entry["fleet_window"] = {
                    "requests": fleet.requests,
                    "errors": fleet.errors,
                    "timed": fleet.timed,
                    "slow": fleet.slow,
                }
            variants.append(entry)
        for entry, weight in zip(variants, self.current_weights(), strict=True):
            entry["current_weight"] = round(weight, 2)
        return {
            "name": self.rollout.name,
            "sticky_key": self.rollout.sticky_key,
            "rolled_back": self.rolled_back.to_json() if self.rolled_back is not None else None,
            "control": self.control.to_json(self.rollout),
            "variants": variants,
        }


@dataclass(frozen=True, slots=True)
class Routed:
    """Where a request naming a rollout goes."""

    rollout: str
    adapter: str
    how: str  # "split", "override" or "rollback"


class Rollouts:
    """The rollouts of one active policy: routing, health windows, rollbacks, sharing."""

    SHARE_PREFIX = "loragate:rollback:"
    CONTROL_PREFIX = "loragate:rollctl:"
    COUNTS_PREFIX = "loragate:rollstats:"
    SLICES = 20  # a pooled window is kept in this many time slices (it slides by window_s / SLICES)
    CONTROL_TTL_S = 30 * 24 * 3600  # a rollout's step outlives any gateway restart

    def __init__(
        self,
        rollouts: Iterable[Rollout],
        share: FleetStore | None = None,
        previous: Rollouts | None = None,
        on_rollback: Callable[[str, RollbackEvent], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        on_step: Callable[[str, Control], None] | None = None,
    ) -> None:
        """`previous`: the rollouts of the policy this one replaces; unchanged rollouts keep their state.
        `on_step(name, control)`: a progressive rollout moved to its next step (or was promoted) here."""
        self.share = share if share is not None else LocalFleetStore()
        self._on_rollback = on_rollback
        self._on_step = on_step
        self._clock = clock
        self._wall = wall
        old = previous.states if previous is not None else {}
        # counts key -> (not yet pooled, the key's TTL in s); a reload hands them on with the states
        self._pending: dict[str, tuple[Counts, int]] = previous._pending if previous is not None else {}
        self.states: dict[str, RolloutState] = {}
        for rollout in rollouts:
            key = f"{self.SHARE_PREFIX}{rollout.name}:{definition_hash(rollout)}"
            kept = old.get(rollout.name)
            self.states[rollout.name] = (
                kept
                if kept is not None and kept.key == key
                else RolloutState(rollout, key, control=Control.initial(rollout, wall()))
            )

    def route(self, name: str, tenant: Tenant, header: Callable[[str], str | None]) -> Routed:
        """The variant for one request; 400 for an override naming no variant, 403 for one not allowed."""
        state = self.states[name]
        rollout = state.rollout
        if rollout.override_header is not None:
            forced = (header(rollout.override_header) or "").strip()
            if forced:
                if forced not in state.windows:
                    names = ", ".join(v.adapter for v in rollout.variants)
                    raise ApiError(
                        400,
                        "invalid_request_error",
                        f"{rollout.override_header}: {shown(forced)} is not a variant of rollout "
                        f"{name!r} (one of: {names})",
                    )
                if not tenant.allows(forced):
                    raise ApiError(
                        403,
                        "permission_denied",
                        f"{rollout.override_header}: adapter {shown(forced)} is not allowed for tenant {tenant.id!r}",
                    )
                return Routed(name, forced, "override")
        if state.rolled_back is not None:
            return Routed(name, rollout.variants[0].adapter, "rollback")
        if state.control.status == PROMOTED:
            return Routed(name, rollout.variants[-1].adapter, "promoted")
        weights = effective_weights(rollout, state.control)
        return Routed(name, pick_variant(rollout, sticky_value(rollout, tenant, header), weights).adapter, "split")

    def record(self, name: str, adapter: str, error: bool, ttft_s: float | None) -> RollbackEvent | None:
        """One finished request of a rollout variant; returns the rollback it triggered, if any."""
        state = self.states.get(name)
        if state is None or adapter not in state.windows:
            return None
        now, wall = self._clock(), self._wall()
        ttft_s = None if error else ttft_s
        state.windows[adapter].add(now, error, ttft_s)
        if self.share.shared and state.rollout.rollback is not None:
            self._count(state, adapter, wall, error, ttft_s)
        decided = state.check(adapter, now, wall)
        if decided is not None:
            self._roll_back(state, decided, published=False)
        return decided

    def _count(self, state: RolloutState, adapter: str, wall: float, error: bool, ttft_s: float | None) -> None:
        """Add one outcome to the counts this replica pools at its next sync."""
        bounds = state.rollout.rollback
        assert bounds is not None
        slice_s = bounds.window_s / self.SLICES
        key = self._counts_key(state, adapter, int(wall // slice_s))
        counts, _ = self._pending.setdefault(key, (Counts(), math.ceil(bounds.window_s + 2 * slice_s)))
        counts.requests += 1
        counts.errors += error
        if ttft_s is not None:
            counts.timed += 1
            counts.slow += ttft_s * 1000 > bounds.max_ttft_p99_ms

    def _counts_key(self, state: RolloutState, adapter: str, slice_index: int) -> str:
        return f"{self.COUNTS_PREFIX}{state.key[len(self.SHARE_PREFIX) :]}:{adapter}:{slice_index}"

    def _window_keys(self, state: RolloutState, adapter: str, wall: float) -> list[str]:
        """The counts keys of `adapter`'s pooled window ending at `wall`."""
        bounds = state.rollout.rollback
        assert bounds is not None
        last = int(wall // (bounds.window_s / self.SLICES))
        return [self._counts_key(state, adapter, i) for i in range(last - self.SLICES + 1, last + 1)]

    def is_rolled_back(self, name: str) -> bool:
        state = self.states.get(name)
        return state is not None and state.rolled_back is not None

    async def sync(self) -> None:
        """Exchange with the other replicas: publish our rollbacks, pool our counts, adopt their rollbacks,
        drop cleared ones, judge the pooled windows; then exchange control states and move progressive
        rollouts whose gate holds to their next step."""
        states = list(self.states.values())
        if not states:
            return
        if not self.share.shared:
            self._progress(states)
            return
        for state in states:
            if state.rolled_back is not None and not state.published:
                await self.share.publish(state.key, state.rolled_back.dumps())
                state.published = True
        await self._pool_counts()
        found = await self.share.fetch([s.key for s in states])
        for state in states:
            shared = RollbackEvent.loads(found[state.key]) if state.key in found else None
            if shared is not None and state.rolled_back is None:
                self._roll_back(state, shared, published=True, adopted=True)
            elif state.key not in found and state.rolled_back is not None and state.published:
                logger.info("rollout %r: rollback cleared by another replica's reload", state.rollout.name)
                state.rolled_back = None
                for window in state.windows.values():
                    window.clear()
        await self._judge_pooled(states)
        await self._exchange_controls(states)
        self._progress(states)
        await self._publish_controls(states)

    def _progress(self, states: list[RolloutState]) -> None:
        """Advance every progressive rollout whose step held within bounds (the fleet's pooled window when
        shared, else this replica's)."""
        now, wall = self._clock(), self._wall()
        for state in states:
            rollout = state.rollout
            if rollout.steps is None or rollout.rollback is None or state.rolled_back is not None:
                continue
            canary = rollout.variants[-1].adapter
            counts = state.fleet.get(canary) if self.share.shared else None
            if counts is None:
                counts = state.windows[canary].counts(now, rollout.rollback.max_ttft_p99_ms)
            breached = verdict(rollout.rollback, canary, counts, wall) is not None
            advanced = next_step(rollout, state.control, counts.requests, breached, wall)
            if advanced is not None:
                state.set_control(advanced)
                if self._on_step is not None:
                    self._on_step(rollout.name, advanced)

    async def _exchange_controls(self, states: list[RolloutState]) -> None:
        """Adopt a newer control state another replica (or an operator there) wrote."""
        found = await self.share.fetch([s.control_key for s in states])
        for state in states:
            theirs = Control.loads(found[state.control_key]) if state.control_key in found else None
            if theirs is not None and theirs.version > state.control.version:
                state.control = theirs
                state.control_dirty = False
                logger.info("rollout %r: %s (adopted from another replica)", state.rollout.name, theirs.decision)
            elif theirs is None and state.control.version > 0 and not state.control_dirty:
                # Published once, gone now: another replica's POST /admin/reload started it afresh (or
                # Redis lost its data: starting over from the first step is the safe direction).
                state.control = Control.initial(state.rollout, self._wall())
                logger.info(
                    "rollout %r: control state cleared by another replica; back to the start", state.rollout.name
                )

    async def _publish_controls(self, states: list[RolloutState]) -> None:
        for state in states:
            if state.control_dirty:
                await self.share.put_newer(
                    state.control_key, state.control.dumps(), state.control.version, self.CONTROL_TTL_S
                )
                state.control_dirty = False

    async def _pool_counts(self) -> None:
        """Add this replica's counts since the last sync to the pooled windows (kept for a later try on error)."""
        pending, self._pending = self._pending, {}
        if not pending:
            return
        try:
            await self.share.add_counts({key: (counts.fields(), ttl) for key, (counts, ttl) in pending.items()})
        except Exception:
            for key, (counts, ttl) in pending.items():  # merge back what arrived meanwhile
                kept, _ = self._pending.setdefault(key, (Counts(), ttl))
                kept.add(counts)
            raise

    async def _judge_pooled(self, states: list[RolloutState]) -> None:
        """Read every pooled window of a later variant and roll back where the fleet's counts call for it."""
        wall = self._wall()
        asks = [
            (state, v.adapter, self._window_keys(state, v.adapter, wall))
            for state in states
            if state.rollout.rollback is not None and state.rolled_back is None
            for v in state.rollout.variants[1:]
        ]
        if not asks:
            return
        found = iter(await self.share.read_counts([key for _, _, keys in asks for key in keys]))
        for state, adapter, keys in asks:
            total = Counts()
            for _ in keys:
                total.add(Counts.from_fields(next(found)))
            state.fleet[adapter] = total
            assert state.rollout.rollback is not None
            decided = (
                None
                if state.rolled_back is not None
                else verdict(state.rollout.rollback, adapter, total, wall, " across the replicas")
            )
            if decided is not None:
                self._roll_back(state, decided, published=False)
                await self.share.publish(state.key, decided.dumps())
                state.published = True

    async def clear_shared(self) -> None:
        """Forget every published rollback and pooled window of these rollouts (POST /admin/reload starts
        afresh)."""
        wall = self._wall()
        keys = [s.key for s in self.states.values()] + [s.control_key for s in self.states.values()]
        keys += [
            key
            for state in self.states.values()
            if state.rollout.rollback is not None
            for v in state.rollout.variants
            for key in self._window_keys(state, v.adapter, wall)
        ]
        self._pending.clear()
        await self.share.clear(keys)

    def weights(self) -> dict[tuple[str, str], float]:
        """(rollout, variant) -> the percent of traffic the split sends there now."""
        return {
            (name, variant.adapter): weight
            for name, state in self.states.items()
            for variant, weight in zip(state.rollout.variants, state.current_weights(), strict=True)
        }

    def describe(self) -> list[dict[str, Any]]:
        now = self._clock()
        return [state.describe(now) for state in self.states.values()]

    # ---- operator actions (POST /admin/rollouts/{name}/{action}) ----

    ACTIONS = ("pause", "resume", "promote", "rollback", "reset")

    async def act(self, name: str, action: str, by: str) -> bool:
        """Apply an operator's action; False when it changes nothing (already in that state). Raises
        KeyError for an unknown rollout and ValueError for an action this rollout cannot take."""
        state = self.states[name]
        rollout, control, wall = state.rollout, state.control, self._wall()
        changed = False
        if action in ("pause", "resume"):
            if rollout.steps is None:
                raise ValueError(f"rollout {name!r} has no steps: there is nothing to {action}")
            if action == "pause" and control.status == PROGRESSING:
                state.set_control(
                    control.changed(wall, by, f"paused at {rollout.steps[control.step]:g}%", status=PAUSED)
                )
                changed = True
            elif action == "resume" and control.status == PAUSED:
                state.set_control(
                    control.changed(
                        wall, by, f"resumed at {rollout.steps[control.step]:g}%", status=PROGRESSING, since=wall
                    )
                )
                changed = True
        elif action == "promote":
            if control.status != PROMOTED or state.rolled_back is not None:
                last = len(rollout.steps) - 1 if rollout.steps is not None else 0
                state.set_control(
                    control.changed(wall, by, "promoted by an operator", status=PROMOTED, step=last, since=wall)
                )
                await self._clear_rollback(state)
                changed = True
        elif action == "rollback":
            if state.rolled_back is None:
                event = RollbackEvent(rollout.variants[-1].adapter, "operator", f"rolled back by {by}", wall)
                self._roll_back(state, event, published=False)
                changed = True
        elif action == "reset":
            fresh = Control.initial(rollout, wall)
            if state.rolled_back is not None or (control.status, control.step) != (fresh.status, fresh.step):
                state.set_control(
                    control.changed(wall, by, "reset by an operator", status=fresh.status, step=0, since=wall)
                )
                await self._clear_rollback(state)
                changed = True
        else:
            raise ValueError(f"unknown action {action!r} (one of: {', '.join(self.ACTIONS)})")
        if changed and self.share.shared:
            await self.sync()  # the fleet sees it within a second; this replica at once
        return changed

    async def _clear_rollback(self, state: RolloutState) -> None:
        """Forget a rollback here and in the shared store, with the windows that led to it."""
        state.rolled_back = None
        state.published = True
        for window in state.windows.values():
            window.clear()
        state.fleet.clear()
        if self.share.shared and state.rollout.rollback is not None:
            wall = self._wall()
            await self.share.clear(
                [state.key] + [key for v in state.rollout.variants for key in self._window_keys(state, v.adapter, wall)]
            )

    def _roll_back(self, state: RolloutState, rollback: RollbackEvent, published: bool, adopted: bool = False) -> None:
        state.rolled_back = rollback
        state.published = published
        first = state.rollout.variants[0].adapter
        logger.warning(
            "rollout %r rolled back to %r%s: variant %r, %s",
            state.rollout.name,
            first,
            " (decided by another replica)" if adopted else "",
            rollback.variant,
            rollback.detail,
        )
        if self._on_rollback is not None and not adopted:
            self._on_rollback(state.rollout.name, rollback)
