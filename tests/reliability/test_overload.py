"""Three times more arrivals than the stack can serve, from clients that do not slow down when it does
(an open loop), mixed tenants and priorities, counted from the clients' side."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

from rawhttp import gather_tally, open_loop, post_json
from stack import GREEDY, PROMPT, REASONS, SCALE, Stack, auth

# The shared stack admits 2 engines x 4 in flight + 8 queued = 16 at once.
ADMITTED = 16


def _capacity(stack: Stack) -> float:
    """Requests per second the stack serves when kept full (closed loop at what it admits)."""
    call = lambda: post_json(stack.url, "/v1/completions", {"prompt": PROMPT, **GREEDY}, auth("globex"))  # noqa: E731
    start = time.monotonic()
    tally = asyncio.run(gather_tally([call] * (4 * ADMITTED), concurrency=ADMITTED))
    assert tally.by_status() == {200: 4 * ADMITTED}
    return len(tally.answers) / (time.monotonic() - start)


def _plan(count: int) -> list[tuple[str, str, str | None]]:
    """(tenant, priority, adapter) per request: 5% critical (acme), 35% standard, 60% sheddable."""
    rng = random.Random(11)
    plan = []
    for _ in range(count):
        roll = rng.random()
        if roll < 0.05:
            plan.append(("acme", "critical", rng.choice(["acme-a", "acme-b", None])))
        elif roll < 0.4:
            plan.append(("globex", "standard", rng.choice(["globex-a", None])))
        else:
            plan.append(("initech", "sheddable", rng.choice(["acme-a", "globex-a", None])))
    return plan


def test_three_times_overload_gets_every_request_exactly_one_true_answer(
    stack: Stack, references: dict[str | None, str]
) -> None:
    rate = 3 * _capacity(stack)
    plan = _plan(int(3 * rate) * SCALE)  # about three seconds of arrivals

    def call(tenant: str, priority: str, adapter: str | None):
        headers = {**auth(tenant), "X-Priority": priority, **({"X-Adapter-ID": adapter} if adapter else {})}
        return lambda: post_json(
            stack.url, "/v1/completions", {"prompt": PROMPT, **GREEDY}, headers, tag=(tenant, priority, adapter)
        )

    tally = asyncio.run(open_loop([call(*p) for p in plan], rate))

    assert not tally.failures, tally.failures[:3]  # every request got a whole answer, none hung
    assert len(tally.answers) == len(plan)
    statuses = tally.by_status()
    assert set(statuses) <= {200, 429, 503}, statuses  # no 5xx but 503, nothing else
    assert statuses.get(503, 0) > 0, "the stack was not overloaded: nothing was shed"
    for answer in tally.answers:
        if answer.status in (429, 503):
            assert int(answer.headers["retry-after"]) >= 1
            assert answer.headers["x-loragate-reason"] in REASONS, answer.headers
        else:  # served under load: still exactly PEFT's greedy text, from the adapter it names
            _tenant, _priority, adapter = answer.tag
            assert answer.headers["x-loragate-adapter"] == (adapter or answer.json()["model"])
            assert answer.json()["choices"][0]["text"] == references[adapter]

    outcomes = Counter((a.tag[1], a.status, a.headers.get("x-loragate-reason")) for a in tally.answers)
    served = Counter(a.tag[1] for a in tally.answers if a.status == 200)
    sent = Counter(p[1] for p in plan)
    rates = {band: served[band] / sent[band] for band in ("critical", "standard", "sheddable")}
    # Critical work goes first: a full queue sheds the lowest band's newest waiter, so a critical request
    # is shed only when the queue holds nothing but critical ones (when the overloaded machine serves
    # less than the critical arrivals alone).
    assert rates["critical"] >= 0.9 and rates["critical"] > rates["standard"] > rates["sheddable"], outcomes
    reasons = Counter(a.headers["x-loragate-reason"] for a in tally.answers if a.status == 503)
    assert set(reasons) <= {"queue_full", "queue_timeout"}, reasons
    stack.wait_idle()
    assert sum(u["inflight"] for u in stack.admin_policy()["routing"]["upstreams"]) == 0
