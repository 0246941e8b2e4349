"""Request priority classes (`X-Priority`), shared by the gateway's admission and the engine's scheduler."""

from __future__ import annotations

import enum


class Priority(enum.IntEnum):
    """Lower value is served first."""

    CRITICAL = 0
    STANDARD = 1
    SHEDDABLE = 2

    @classmethod
    def parse(cls, value: str | None) -> Priority:
        """Parse an `X-Priority` header value; `None` or empty gives STANDARD."""
        if value is None or value.strip() == "":
            return cls.STANDARD
        try:
            return cls[value.strip().upper()]
        except KeyError:
            names = ", ".join(p.name.lower() for p in cls)
            shown = repr(value) if len(value) <= 100 else f"{value[:100]!r}..."
            raise ValueError(f"X-Priority must be one of {names}, got {shown}") from None
