"""Circuit breaker transitions (fake clock) and the admission controller's queue, order and shedding."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from gateway.admission import AdmissionController, Shed, Slot, Upstream
from gateway.breaker import CircuitBreaker
from loragate_common.priority import Priority

from fake_clock import FakeClock

CRIT, STD, SHED = Priority.CRITICAL, Priority.STANDARD, Priority.SHEDDABLE


def make(
    urls: tuple[str, ...] = ("http://a",),
    cap: int = 1,
    max_queue: int = 16,
    timeout_s: float = 5.0,
    breaker: Callable[[], CircuitBreaker] = CircuitBreaker,
) -> AdmissionController:
    upstreams = [Upstream(url, breaker()) for url in urls]
    return AdmissionController(upstreams, cap, max_queue, timeout_s)


async def settle() -> None:
    """Let every runnable task reach its next await (enough for waiters to queue or be woken)."""
    for _ in range(10):
        await asyncio.sleep(0)


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), timeout=5))


# ---------------------------------------------------------------- breaker


def test_breaker_closed_open_half_open_closed() -> None:
    clock = FakeClock()
    b = CircuitBreaker(failure_threshold=3, open_seconds=10, half_open_probes=1, clock=clock)
    b.record_failure()
    b.record_failure()
    b.record_success()  # resets the consecutive count
    b.record_failure()
    b.record_failure()
    assert b.state == "closed" and b.allow()
    b.record_failure()
    assert b.state == "open" and not b.allow()
    assert b.retry_after_s() == pytest.approx(10)
    clock.advance(9.5)
    assert b.state == "open" and not b.allow()
    assert b.retry_after_s() == pytest.approx(0.5)
    clock.advance(0.5)
    assert b.state == "half_open" and b.retry_after_s() == 0
    assert b.allow()  # the one probe
    assert not b.allow()  # probe limit reached
    b.record_success()
    assert b.state == "closed" and b.allow() and b.allow()
    b.record_failure()
    b.record_failure()
    assert b.state == "closed"  # the count started again after closing


def test_breaker_half_open_failure_reopens_for_fresh_period() -> None:
    clock = FakeClock()
    b = CircuitBreaker(failure_threshold=1, open_seconds=5, half_open_probes=1, clock=clock)
    b.record_failure()
    clock.advance(5)
    assert b.allow() and b.state == "half_open"
    clock.advance(2)
    b.record_failure()
    assert b.state == "open" and not b.allow()
    assert b.retry_after_s() == pytest.approx(5)
    clock.advance(4.9)
    assert b.state == "open"
    clock.advance(0.1)
    assert b.state == "half_open" and b.allow()


def test_breaker_answered_failure_keeps_the_count_and_closes_a_half_open_breaker() -> None:
    clock = FakeClock()
    b = CircuitBreaker(failure_threshold=2, open_seconds=5, half_open_probes=1, clock=clock)
    b.record_failure()
    b.record_answered()  # neither a failure nor a reset of the consecutive count
    assert b.state == "closed" and b.consecutive_failures == 1
    b.record_failure()
    assert b.state == "open"
    b.record_answered()  # a late answer while open changes nothing
    assert b.state == "open"
    clock.advance(5)
    assert b.allow() and b.state == "half_open"
    b.record_answered()  # the probe got an answer: the upstream is up
    assert b.state == "closed" and b.consecutive_failures == 0


def test_breaker_probe_limit_and_lost_probe() -> None:
    clock = FakeClock()
    b = CircuitBreaker(failure_threshold=1, open_seconds=5, half_open_probes=2, clock=clock)
    b.record_failure()
    clock.advance(5)
    assert b.allow() and b.allow()
    assert not b.allow() and not b.can_allow()
    clock.advance(5)  # both probes never reported: their places come back
    assert b.can_allow() and b.allow()


def test_breaker_ignores_late_outcomes_while_open_and_notifies_changes() -> None:
    clock = FakeClock()
    b = CircuitBreaker(failure_threshold=1, open_seconds=5, clock=clock)
    changes: list[str] = []
    b.subscribe(lambda: changes.append(b.state))
    b.record_failure()
    clock.advance(1)
    b.record_success()  # a request started before the breaker opened
    b.record_failure()
    assert b.state == "open" and b.retry_after_s() == pytest.approx(4)
    clock.advance(4)
    b.record_success()
    assert changes == ["open", "closed"]


# ---------------------------------------------------------------- admission


async def serve_in_order(ctl: AdmissionController, jobs: list[tuple[str, Priority, str]]) -> list[str]:
    """Hold the only slot, queue `jobs` (name, priority, tenant) in order, free it, return the serve order."""
    hold = await ctl.acquire(STD, "holder")
    served: list[str] = []

    async def job(name: str, priority: Priority, tenant: str) -> None:
        slot = await ctl.acquire(priority, tenant)
        served.append(name)
        slot.release()

    tasks = []
    for name, priority, tenant in jobs:
        tasks.append(asyncio.create_task(job(name, priority, tenant)))
        await settle()
    assert sum(ctl.queue_depths().values()) == len(jobs)
    hold.release()
    await asyncio.gather(*tasks)
    return served


def test_priority_bands_served_in_order() -> None:
    async def main() -> None:
        ctl = make()
        jobs = [("s1", SHED, "t"), ("t1", STD, "t"), ("c1", CRIT, "t"), ("t2", STD, "t"), ("c2", CRIT, "u")]
        assert await serve_in_order(ctl, jobs) == ["c1", "c2", "t1", "t2", "s1"]
        assert ctl.inflight() == {"http://a": 0}

    run(main)


def test_tenants_take_turns_within_a_band() -> None:
    async def main() -> None:
        ctl = make()
        jobs = [(f"A{i}", STD, "A") for i in range(6)] + [(f"B{i}", STD, "B") for i in range(2)]
        served = await serve_in_order(ctl, jobs)
        assert {"B0", "B1"} <= set(served[:4])
        assert served == ["A0", "B0", "A1", "B1", "A2", "A3", "A4", "A5"]

    run(main)


def test_queue_full_sheds_lowest_newest_queued_then_arrival() -> None:
    async def main() -> None:
        ctl = make(max_queue=3)
        hold = await ctl.acquire(STD, "h")
        old = asyncio.create_task(ctl.acquire(SHED, "x"))
        await settle()
        new = asyncio.create_task(ctl.acquire(SHED, "y"))
        await settle()
        std = asyncio.create_task(ctl.acquire(STD, "z"))
        await settle()
        crit = asyncio.create_task(ctl.acquire(CRIT, "w"))  # displaces the newest sheddable
        await settle()
        assert new.done() and isinstance(new.exception(), Shed)
        assert new.exception().reason == "queue_full" and new.exception().status == 503
        assert not old.done()
        assert ctl.queue_depths() == {"critical": 1, "standard": 1, "sheddable": 1}
        crit2 = asyncio.create_task(ctl.acquire(CRIT, "w"))  # displaces the remaining sheddable
        await settle()
        assert isinstance(old.exception(), Shed) and old.exception().reason == "queue_full"
        with pytest.raises(Shed) as err:  # nothing queued is lower than standard: the arrival goes
            await ctl.acquire(STD, "v")
        assert err.value.reason == "queue_full" and err.value.retry_after_s > 0
        hold.release()
        first = await crit
        first.release()
        (await crit2).release()
        (await std).release()
        assert ctl.queue_depths() == {"critical": 0, "standard": 0, "sheddable": 0}

    run(main)


def test_queue_timeout() -> None:
    async def main() -> None:
        ctl = make(timeout_s=0.05)
        hold = await ctl.acquire(STD, "h")
        with pytest.raises(Shed) as err:
            await ctl.acquire(CRIT, "t")
        assert err.value.reason == "queue_timeout" and err.value.retry_after_s > 0
        assert ctl.queue_depths()["critical"] == 0
        hold.release()
        assert ctl.inflight() == {"http://a": 0}

    run(main)


def test_cancelled_waiter_leaves_queue() -> None:
    async def main() -> None:
        ctl = make()
        hold = await ctl.acquire(STD, "h")
        gone = asyncio.create_task(ctl.acquire(STD, "t"))
        await settle()
        assert ctl.queue_depths()["standard"] == 1
        gone.cancel()
        await settle()
        assert gone.cancelled() and ctl.queue_depths()["standard"] == 0
        hold.release()
        assert ctl.inflight() == {"http://a": 0}  # the slot was not handed to the cancelled waiter
        slot = await asyncio.wait_for(ctl.acquire(STD, "t"), 1)
        assert slot.upstream.url == "http://a"

    run(main)


def test_waiter_cancelled_in_the_tick_it_is_granted_returns_the_slot() -> None:
    async def main() -> None:
        ctl = make()
        hold = await ctl.acquire(STD, "h")
        gone = asyncio.create_task(ctl.acquire(STD, "t"))
        await settle()
        hold.release()  # grants the waiter's future; its task has not resumed yet
        gone.cancel()
        await settle()
        assert gone.cancelled()
        assert ctl.inflight() == {"http://a": 0}

    run(main)


def test_circuit_open_with_soonest_retry_after() -> None:
    async def main() -> None:
        clock = FakeClock()
        breakers = iter([CircuitBreaker(1, 10, clock=clock), CircuitBreaker(1, 4, clock=clock)])
        ctl = make(urls=("http://a", "http://b"), breaker=lambda: next(breakers))
        for upstream in ctl.upstreams:
            upstream.breaker.record_failure()
        clock.advance(1)
        with pytest.raises(Shed) as err:
            await ctl.acquire(CRIT, "t")
        assert err.value.reason == "circuit_open"
        assert err.value.retry_after_s == pytest.approx(3)
        clock.advance(3)
        probe = await ctl.acquire(CRIT, "t")
        assert probe.upstream.url == "http://b"
        with pytest.raises(Shed) as err:  # b's one probe is out, a is still open
            await ctl.acquire(CRIT, "t")
        assert err.value.reason == "circuit_open"

    run(main)


def test_no_upstream() -> None:
    async def main() -> None:
        with pytest.raises(Shed) as err:
            await make(urls=()).acquire(STD, "t")
        assert err.value.reason == "no_upstream"
        with pytest.raises(Shed) as err:
            await make().acquire(STD, "t", exclude=frozenset({"http://a"}))
        assert err.value.reason == "no_upstream"

    run(main)


def test_drain_fails_queued_and_refuses_new() -> None:
    async def main() -> None:
        ctl = make()
        hold = await ctl.acquire(STD, "h")
        queued = asyncio.create_task(ctl.acquire(CRIT, "t"))
        await settle()
        ctl.drain()
        await settle()
        assert isinstance(queued.exception(), Shed) and queued.exception().reason == "draining"
        assert ctl.draining and sum(ctl.queue_depths().values()) == 0
        with pytest.raises(Shed) as err:
            await ctl.acquire(CRIT, "t")
        assert err.value.reason == "draining"
        hold.release()
        assert ctl.inflight() == {"http://a": 0}

    run(main)


def test_least_inflight_upstream_is_chosen() -> None:
    async def main() -> None:
        ctl = make(urls=("http://a", "http://b"), cap=2)
        s1 = await ctl.acquire(STD, "t")
        s2 = await ctl.acquire(STD, "t")
        assert {s1.upstream.url, s2.upstream.url} == {"http://a", "http://b"}
        s1.release()
        s1.release()  # idempotent
        s3 = await ctl.acquire(STD, "t")
        assert s3.upstream is s1.upstream
        s4 = await ctl.acquire(STD, "t")
        assert sorted(ctl.inflight().values()) == [1, 2]
        s5 = await ctl.acquire(STD, "t")
        assert s5.upstream is not s4.upstream
        assert ctl.inflight() == {"http://a": 2, "http://b": 2}
        for slot in (s2, s3, s4, s5):
            slot.release()
        assert ctl.inflight() == {"http://a": 0, "http://b": 0}

    run(main)


def test_exclude_is_honoured_without_blocking_others() -> None:
    async def main() -> None:
        ctl = make(urls=("http://a", "http://b"), cap=2)
        not_a = frozenset({"http://a"})
        held = [await ctl.acquire(STD, "t", exclude=not_a) for _ in range(2)]
        assert [s.upstream.url for s in held] == ["http://b", "http://b"]
        retry = asyncio.create_task(ctl.acquire(STD, "t", exclude=not_a))
        await settle()
        assert not retry.done() and ctl.queue_depths()["standard"] == 1
        other = await asyncio.wait_for(ctl.acquire(STD, "u"), 1)  # a has room for a request that may use it
        assert other.upstream.url == "http://a"
        held[0].release()
        slot = await asyncio.wait_for(retry, 1)
        assert slot.upstream.url == "http://b" and slot.wait_s >= 0

    run(main)


def test_breaker_closing_wakes_waiter_after_release() -> None:
    async def main() -> None:
        clock = FakeClock()
        breakers = iter([CircuitBreaker(1, 10, clock=clock), CircuitBreaker(1, 10, clock=clock)])
        ctl = make(urls=("http://a", "http://b"), breaker=lambda: next(breakers))
        a, b = ctl.upstreams
        a.breaker.record_failure()
        clock.advance(10)
        probe = await ctl.acquire(STD, "t")  # b is less loaded only by rotation; both are empty
        other = await ctl.acquire(STD, "t")
        if probe.upstream is b:
            probe, other = other, probe
        assert probe.upstream is a and a.breaker.state == "half_open"
        waiter = asyncio.create_task(ctl.acquire(STD, "t"))
        await settle()
        probe.release()  # the app releases first, then records the outcome
        await settle()
        assert not waiter.done()  # a's probe has not reported yet
        a.breaker.record_success()
        slot = await asyncio.wait_for(waiter, 1)
        assert slot.upstream is a and a.breaker.state == "closed"

    run(main)


def test_waiter_gets_probe_when_open_breaker_turns_half_open() -> None:
    async def main() -> None:
        ctl = make(breaker=lambda: CircuitBreaker(failure_threshold=1, open_seconds=0.05))
        first = await ctl.acquire(STD, "t")
        waiter = asyncio.create_task(ctl.acquire(STD, "t"))
        await settle()
        first.upstream.breaker.record_failure()
        first.release()
        await settle()
        assert not waiter.done()
        slot = await asyncio.wait_for(waiter, 1)  # woken by the timer, not by another release
        assert isinstance(slot, Slot) and slot.upstream.breaker.state == "half_open"

    run(main)


def test_queued_waiter_not_overtaken_when_breaker_turns_half_open() -> None:
    async def main() -> None:
        clock = FakeClock()
        ctl = make(breaker=lambda: CircuitBreaker(failure_threshold=1, open_seconds=10, clock=clock))
        first = await ctl.acquire(STD, "t")
        waiter = asyncio.create_task(ctl.acquire(CRIT, "t"))
        await settle()
        first.upstream.breaker.record_failure()
        first.release()
        clock.advance(10)  # half-open now, but no timer has fired (the fake clock moved, not the loop's)
        late = asyncio.create_task(ctl.acquire(STD, "u"))
        await settle()
        assert waiter.done() and waiter.result().upstream is first.upstream  # the queued one got the probe
        assert not late.done()
        late.cancel()

    run(main)


def test_closed_controller_ignores_breaker_changes() -> None:
    async def main() -> None:
        clock = FakeClock()
        ctl = make(breaker=lambda: CircuitBreaker(failure_threshold=1, open_seconds=10, clock=clock))
        first = await ctl.acquire(STD, "t")
        waiter = asyncio.create_task(ctl.acquire(STD, "t"))
        await settle()
        first.upstream.breaker.record_failure()
        clock.advance(10)
        assert first.upstream.breaker.allow()  # another caller's probe
        first.release()
        await settle()
        assert not waiter.done()
        ctl.close()
        first.upstream.breaker.record_success()  # closes the breaker; a closed controller is not told
        await settle()
        assert not waiter.done()
        waiter.cancel()

    run(main)
