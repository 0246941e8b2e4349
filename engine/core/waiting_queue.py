"""The waiting queue's order: priority, then fairness across adapters, then arrival, with aging.

- Priority: critical before standard before sheddable (`Priority`, lower value first).
- Aging: a request gains one class for every `aging_s` seconds it has waited, so no waiting request
  starves behind a stream of higher-priority arrivals.
- Fairness across adapters (start-time fair queueing): each adapter (the base model counts as one) has
  a count of admissions served; within a class, a request's turn is its adapter's count plus its place
  among that adapter's waiting requests, so adapters take turns and a hot adapter's backlog cannot
  starve a cold one. An adapter that starts waiting again catches up to the least-served waiting one,
  so idling earns no burst.
- Arrival (FCFS) breaks the remaining ties; a preempted request keeps its arrival time.

The requests are kept in arrival order as they come (a preempted one is inserted at its place), so ordering
them is one pass for the turns and one sort; the scheduler orders them only in a step that could admit or
preempt for one (`best_class`, kept by counting, tells it when no running request could give way).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterator

from engine.core.request import Request


class WaitingQueue:
    def __init__(self, aging_s: float | None) -> None:
        self.aging_s = aging_s  # None: no aging
        self._requests: list[Request] = []  # in arrival order
        self._served: dict[str | None, int] = {}  # adapter id (None: base) -> admissions
        self._classes: Counter[int] = Counter()  # priority class -> requests waiting
        # adapter id (None: base) -> requests waiting, kept as they come and go: the engine's load report
        # reads it every step without walking the queue
        self._adapters: Counter[str | None] = Counter()

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def __contains__(self, request: Request) -> bool:
        return request in self._requests

    def add(self, request: Request) -> None:
        key = request.adapter_id
        if self._requests and all(r.adapter_id != key for r in self._requests):
            floor = min(self._served.get(r.adapter_id, 0) for r in self._requests)
            self._served[key] = max(self._served.get(key, 0), floor)
        if not self._requests or self._requests[-1].arrival_time <= request.arrival_time:
            self._requests.append(request)
        else:  # preempted: back at its place in arrival order
            bisect.insort_right(self._requests, request, key=lambda r: r.arrival_time)
        self._classes[int(request.priority)] += 1
        self._adapters[request.adapter_id] += 1

    def remove(self, request: Request) -> None:
        """Take a request out without serving it (abort)."""
        self._requests.remove(request)
        self._classes[int(request.priority)] -= 1
        key = request.adapter_id
        self._adapters[key] -= 1
        if not self._adapters[key]:  # only adapters with waiting requests: it stays as small as the queue's mix
            del self._adapters[key]

    def admit(self, request: Request) -> None:
        """Take a request out because it is being served: its adapter's turn count moves on."""
        self.remove(request)
        self._served[request.adapter_id] = self._served.get(request.adapter_id, 0) + 1

    def effective_priority(self, request: Request, now: float) -> int:
        if self.aging_s is None:
            return int(request.priority)
        waited = max(0.0, now - request.arrival_time)
        return max(0, int(request.priority) - int(waited / self.aging_s))

    def best_class(self) -> int | None:
        """The best (lowest) priority class waiting, before aging; None when nothing waits."""
        if not self._requests:  # the usual case in steady decoding: no need to look at the classes
            return None
        return min((c for c, n in self._classes.items() if n), default=None)

    def count_by_adapter(self) -> tuple[tuple[str | None, int], ...]:
        """(adapter id or None for the base model, requests waiting) for every adapter with one."""
        return tuple(self._adapters.items())

    def ordered(self, now: float) -> list[Request]:
        """The waiting requests in the order they should be admitted at time `now`."""
        prio = {id(r): self.effective_priority(r, now) for r in self._requests}
        turn: dict[int, int] = {}  # adapter's admissions + place among its (class, adapter) peers
        seen: dict[tuple[int, str | None], int] = {}
        for r in self._requests:  # in arrival order
            peers = (prio[id(r)], r.adapter_id)
            place = seen.get(peers, 0)
            seen[peers] = place + 1
            turn[id(r)] = self._served.get(r.adapter_id, 0) + place
        return sorted(self._requests, key=lambda r: (prio[id(r)], turn[id(r)], r.arrival_time))
