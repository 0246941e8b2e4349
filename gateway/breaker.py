"""A per-upstream circuit breaker: closed -> open -> half_open -> closed.

- closed: every request is allowed; `failure_threshold` CONSECUTIVE failures open it (a success resets the
  count).
- open: nothing is allowed for `open_seconds`; then the breaker is half_open. The open -> half_open step is
  computed lazily from the clock by `state`, so no timer is needed.
- half_open: up to `half_open_probes` requests are let through at once as probes. The first success closes
  the breaker; a failure opens it again for a fresh `open_seconds`. A probe that never reports (its client
  went away and nobody recorded an outcome) gives its place back after `open_seconds`, so a lost probe
  cannot hold the breaker half-open for ever.

`record_answered` is for an upstream that answered but failed the request for a reason of its own (the
proxy's case: an engine's 500): it counts neither way while closed, and closes a half-open breaker, since
the probe got through.

Outcomes that arrive while the breaker is open come from requests started before it opened; they are
ignored, so a late success does not close the breaker early and a late failure does not extend it.
Listeners (`subscribe`) are called after every state change that `record_*` makes, so an admission queue
can hand out slots as soon as a breaker closes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

State = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int = 5,
        open_seconds: float = 10.0,
        half_open_probes: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.reconfigure(failure_threshold, open_seconds, half_open_probes)
        self._clock = clock
        self._failures = 0  # consecutive failures while closed
        self._opened_at: float | None = None  # None: closed
        self._probes = 0  # probes handed out since the breaker last became half-open, not yet reported
        self._last_probe_at = 0.0
        self._listeners: list[Callable[[], None]] = []

    def reconfigure(self, failure_threshold: int, open_seconds: float, half_open_probes: int) -> None:
        """New settings (a policy reload); the state and the failures counted so far are kept."""
        assert failure_threshold >= 1 and open_seconds >= 0 and half_open_probes >= 1
        self.failure_threshold = failure_threshold
        self.open_seconds = open_seconds
        self.half_open_probes = half_open_probes

    @property
    def state(self) -> State:
        if self._opened_at is None:
            return "closed"
        if self._clock() - self._opened_at >= self.open_seconds:
            return "half_open"
        return "open"

    @property
    def consecutive_failures(self) -> int:
        return self._failures

    def subscribe(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def unsubscribe(self, listener: Callable[[], None]) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def can_allow(self) -> bool:
        """Whether `allow()` would say yes now, without taking a probe place."""
        state = self.state
        if state == "closed":
            return True
        if state == "open":
            return False
        self._expire_lost_probes()
        return self._probes < self.half_open_probes

    def allow(self) -> bool:
        """May a request go to this upstream now? When half-open, a yes takes one probe place."""
        if not self.can_allow():
            return False
        if self.state == "half_open":
            self._probes += 1
            self._last_probe_at = self._clock()
        return True

    def record_success(self) -> None:
        state = self.state
        if state == "closed":
            self._failures = 0
        elif state == "half_open":
            self._close()
            self._notify()

    def record_answered(self) -> None:
        """The upstream answered, but the request failed for a reason of its own (e.g. a 500 for one
        adapter): proof of life for a half-open probe, and no failure of the upstream's."""
        if self.state == "half_open":
            self._close()
            self._notify()

    def record_failure(self) -> None:
        state = self.state
        if state == "closed":
            self._failures += 1
            if self._failures >= self.failure_threshold:
                self._open()
                self._notify()
        elif state == "half_open":
            self._open()
            self._notify()

    def reset(self) -> bool:
        """Close the breaker now (an operator's action); False when it was closed with no failures counted."""
        if self._opened_at is None and self._failures == 0:
            return False
        self._close()
        self._notify()
        return True

    def retry_after_s(self) -> float:
        """Seconds until the breaker lets a probe through (0 unless open)."""
        if self._opened_at is None:
            return 0.0
        return max(0.0, self._opened_at + self.open_seconds - self._clock())

    def _open(self) -> None:
        self._opened_at = self._clock()
        self._probes = 0

    def _close(self) -> None:
        self._opened_at = None
        self._failures = 0
        self._probes = 0

    def _expire_lost_probes(self) -> None:
        if self._probes and self._clock() - self._last_probe_at >= self.open_seconds:
            self._probes = 0

    def _notify(self) -> None:
        for listener in list(self._listeners):
            listener()
