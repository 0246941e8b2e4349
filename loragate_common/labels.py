"""Bounded values for a Prometheus label that names an adapter, shared by the engine's and the gateway's
metrics: however many adapters exist, the number of series stays bounded."""

from __future__ import annotations


class BoundedLabels:
    """`named` values always keep their own; of the others, the first `max_own` given out (`assign`) keep
    theirs and every later one is `OTHER`. A value once given out keeps it, so counters stay monotonic; a
    value literally named "other" is counted as OTHER."""

    OTHER = "other"

    def __init__(self, max_own: int) -> None:
        self.max_own = max_own
        self.named: frozenset[str] = frozenset()
        self.own: dict[str, None] = {}  # the values given out, in the order first seen

    def assign(self, value: str) -> str:
        """The label of `value`, giving it one of its own while there is room."""
        if value not in self.named and value not in self.own and value != self.OTHER and len(self.own) < self.max_own:
            self.own[value] = None
        return self.label(value)

    def label(self, value: str) -> str:
        """The label of `value` as things are (never gives one out)."""
        return value if value in self.named or value in self.own else self.OTHER
