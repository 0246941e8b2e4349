"""A rollout's control state: its step, whether it is paused or promoted, and the last decision and why.

Progressive rollouts (`steps` in the policy, Flagger / Argo Rollouts style, here in the gateway): the new
variant's weight walks through `steps` (e.g. 5 -> 25 -> 50 -> 100). A step is held for `hold_s`; when the
rollback bounds hold over the new variant's window (at least `min_requests` in it, error rate and TTFT p99
within bounds) at the end of the hold, the next step starts; a breach rolls the rollout back (the
rollback machinery of gateway/rollout.py); reaching 100 marks it `promoted`. Operators pause, resume,
promote, roll back and reset through the admin API.

With Redis the control state is one key per rollout definition, holding a JSON `Control` whose `version`
grows with every change: every replica adopts the newest it finds (about once a second), so all serve the
same step, and a restarted gateway resumes where the fleet is. A change is written only if the stored
version is older (a Lua compare-and-set), so two replicas deciding the same step at once agree.
Without Redis each replica keeps its own.

Sticky users stay sticky: the split walks buckets over [current variant, new variant] in that order, so
raising the new variant's weight lowers the first bound and only moves users from the current variant
to the new one, never back (tests/gateway/test_gateway_progressive.py checks it bucket by bucket).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any

from gateway.clock import iso_time
from gateway.policy import Rollout

PROGRESSING, PAUSED, PROMOTED, STEADY = "progressing", "paused", "promoted", "steady"


@dataclass(frozen=True, slots=True)
class Control:
    step: int = 0  # index into the rollout's steps (progressive rollouts)
    since: float = 0.0  # wall-clock time the current step (or status) began
    status: str = STEADY  # progressing | paused | promoted (progressive), steady | promoted (plain splits)
    decision: str = "defined by the policy"  # the last decision, and why
    decided_at: float = 0.0
    by: str = "policy"  # who: "gate", "policy", or an operator's admin key fingerprint
    version: int = 0  # grows with every change; replicas adopt the highest

    @classmethod
    def initial(cls, rollout: Rollout, wall: float) -> Control:
        status = PROGRESSING if rollout.progressive else STEADY
        return cls(
            0,
            wall,
            status,
            "started at the first step" if rollout.progressive else "defined by the policy",
            wall,
            "policy",
            0,
        )

    def changed(self, wall: float, by: str, decision: str, **fields: Any) -> Control:
        return replace(self, **fields, decision=decision, decided_at=wall, by=by, version=self.version + 1)

    def dumps(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def loads(cls, text: str) -> Control | None:
        try:
            data = json.loads(text)
            return cls(
                int(data["step"]),
                float(data["since"]),
                str(data["status"]),
                str(data["decision"]),
                float(data["decided_at"]),
                str(data["by"]),
                int(data["version"]),
            )
        except (ValueError, KeyError, TypeError):
            return None

    def to_json(self, rollout: Rollout) -> dict[str, Any]:
        out: dict[str, Any] = {
            "status": self.status,
            "decision": self.decision,
            "by": self.by,
            "decided_at": iso_time(self.decided_at),
            "since": iso_time(self.since),
        }
        if rollout.steps is not None:
            out.update(
                step=self.step, weight=rollout.steps[self.step], steps=list(rollout.steps), hold_s=rollout.hold_s
            )
        return out


def effective_weights(rollout: Rollout, control: Control) -> list[float]:
    """The weights the split uses now: all to the last variant once promoted; a progressive rollout's step
    (the new variant's percent, the rest to the first); else the policy's weights."""
    n = len(rollout.variants)
    if control.status == PROMOTED:
        return [0.0] * (n - 1) + [1.0]
    if rollout.steps is not None:
        weight = rollout.steps[control.step]
        return [100.0 - weight, weight]
    return [v.weight for v in rollout.variants]


def next_step(rollout: Rollout, control: Control, requests: int, breached: bool, wall: float) -> Control | None:
    """The control after a gate check, or None when nothing changes.

    A step advances when it has been held for `hold_s` and the new variant's window has `min_requests`
    within the bounds (`breached` False); a breach itself is the rollback's business."""
    if rollout.steps is None or control.status != PROGRESSING or breached:
        return None
    assert rollout.hold_s is not None and rollout.rollback is not None
    if wall - control.since < rollout.hold_s or requests < rollout.rollback.min_requests:
        return None
    step = control.step + 1
    weight = rollout.steps[step]
    held = (
        f"held {rollout.steps[control.step]:g}% for {wall - control.since:.0f} s within bounds over {requests} requests"
    )
    if weight >= 100:
        return control.changed(wall, "gate", f"promoted: {held}", step=step, since=wall, status=PROMOTED)
    return control.changed(
        wall, "gate", f"step {step + 1}/{len(rollout.steps)} ({weight:g}%): {held}", step=step, since=wall
    )
