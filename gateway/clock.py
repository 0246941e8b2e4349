"""Wall-clock times as the admin API shows them."""

from __future__ import annotations

import time


def iso_time(t: float) -> str:
    """`t` (seconds since the epoch) as UTC ISO 8601, to the second: 2026-12-01T02:30:00Z."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
