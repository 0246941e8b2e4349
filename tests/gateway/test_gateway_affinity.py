"""Adapter-affinity routing: rendezvous hashing, the spill rule, breakers and queued waiters with affinity."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from gateway.admission import AdmissionController, EngineLoad, Slot, Upstream, rendezvous_order
from gateway.breaker import CircuitBreaker
from loragate_common.priority import Priority

from fake_clock import FakeClock

CRIT, STD = Priority.CRITICAL, Priority.STANDARD
URLS = ("http://a", "http://b", "http://c")
REPO = Path(__file__).resolve().parents[2]


def make(
    urls: tuple[str, ...] = URLS,
    cap: int = 4,
    spill: int | None = 2,
    breaker: Callable[[], CircuitBreaker] = CircuitBreaker,
) -> AdmissionController:
    upstreams = [Upstream(url, breaker()) for url in urls]
    return AdmissionController(upstreams, cap, 16, 5.0, spill_inflight=spill)


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), timeout=5))


def adapter_preferring(url: str, urls: tuple[str, ...] = URLS, skip: int = 0) -> str:
    """An adapter id whose first rendezvous choice among `urls` is `url` (the skip-th such id)."""
    for i in range(10_000):
        key = f"adapter-{i}"
        if rendezvous_order(key, urls)[0] == url:
            if skip == 0:
                return key
            skip -= 1
    raise AssertionError(f"no adapter prefers {url}")


async def occupy(ctl: AdmissionController, url: str, n: int) -> list[Slot]:
    """Put `n` base-model requests in flight on `url` (by excluding every other upstream)."""
    others = frozenset(u.url for u in ctl.upstreams if u.url != url)
    slots = [await ctl.acquire(STD, "load", exclude=others) for _ in range(n)]
    assert all(s.upstream.url == url for s in slots)
    return slots


# ---------------------------------------------------------------- rendezvous_order


def test_rendezvous_order_is_a_permutation_and_stable_across_processes() -> None:
    urls = ["http://a:8000", "http://b:8000", "http://c:8000", "http://d:8000"]
    keys = [f"tenant-{i}/adapter" for i in range(20)] + ["", "ünïcode", "a" * 300]
    here = {key: rendezvous_order(key, urls) for key in keys}
    assert all(sorted(order) == sorted(urls) for order in here.values())
    assert len({tuple(order) for order in here.values()}) > 1  # the key matters
    script = (
        "import json, sys\n"
        "from gateway.admission import rendezvous_order\n"
        "keys, urls = json.load(sys.stdin)\n"
        "print(json.dumps({k: rendezvous_order(k, urls) for k in keys}))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # a different hash() salt must not matter
    done = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps([keys, urls]),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(done.stdout) == here
    assert rendezvous_order("x", urls[::-1]) == rendezvous_order("x", urls)  # input order is irrelevant


def test_rendezvous_spreads_adapters_evenly() -> None:
    urls = ["http://a", "http://b", "http://c", "http://d"]
    owners = Counter(rendezvous_order(f"adapter-{i}", urls)[0] for i in range(1000))
    assert set(owners) == set(urls)
    for url in urls:
        assert 180 <= owners[url] <= 320, owners


def test_removing_an_upstream_moves_only_its_adapters_and_adding_moves_only_to_the_new_one() -> None:
    urls = ["http://a", "http://b", "http://c", "http://d"]
    keys = [f"adapter-{i}" for i in range(1000)]
    before = {k: rendezvous_order(k, urls)[0] for k in keys}
    fewer = [u for u in urls if u != "http://c"]
    after = {k: rendezvous_order(k, fewer)[0] for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == "http://c"} and moved
    for k in moved:  # each orphan goes to its second choice
        assert after[k] == rendezvous_order(k, urls)[1]
    back = {k: rendezvous_order(k, fewer + ["http://c"])[0] for k in keys}
    assert back == before
    for k in keys:
        if back[k] != after[k]:
            assert back[k] == "http://c"


# ---------------------------------------------------------------- controller


def test_spill_inflight_default_and_clamp() -> None:
    assert make(cap=8, spill=None).spill_inflight == 6
    assert make(cap=1, spill=None).spill_inflight == 1
    assert make(cap=4, spill=100).spill_inflight == 4
    assert make(cap=4, spill=1).spill_inflight == 1


def test_adapter_sticks_to_preferred_spills_when_busy_and_returns() -> None:
    async def main() -> None:
        ctl = make(cap=4, spill=2)
        adapter = adapter_preferring("http://a")
        first, second, third = rendezvous_order(adapter, URLS)
        held = [await ctl.acquire(STD, "t", affinity=adapter) for _ in range(2)]
        assert [s.upstream.url for s in held] == [first, first] and ctl.spills == 0
        # `first` is at spill_inflight: the next calm choice in rendezvous order takes it.
        held += [await ctl.acquire(STD, "t", affinity=adapter) for _ in range(2)]
        assert [s.upstream.url for s in held[2:]] == [second, second] and ctl.spills == 2
        held.append(await ctl.acquire(STD, "t", affinity=adapter))
        assert held[-1].upstream.url == third and ctl.spills == 3
        held[0].release()
        again = await ctl.acquire(STD, "t", affinity=adapter)
        assert again.upstream.url == first and ctl.spills == 3  # back home once below spill
        for slot in held[1:] + [again]:
            slot.release()
        assert ctl.inflight() == dict.fromkeys(URLS, 0)

    run(main)


def test_spill_goes_to_least_loaded_when_every_upstream_is_busy() -> None:
    async def main() -> None:
        ctl = make(cap=4, spill=2)
        adapter = adapter_preferring("http://a")
        first, second, third = rendezvous_order(adapter, URLS)
        await occupy(ctl, first, 3)
        await occupy(ctl, second, 3)
        await occupy(ctl, third, 2)
        slot = await ctl.acquire(STD, "t", affinity=adapter)
        assert slot.upstream.url == third and ctl.spills == 1
        # All at 3 now: a tie, broken by rendezvous order.
        slot = await ctl.acquire(STD, "t", affinity=adapter)
        assert slot.upstream.url == first and ctl.spills == 1  # its first choice after all: no spill
        slot = await ctl.acquire(STD, "t", affinity=adapter)
        assert slot.upstream.url == second and ctl.spills == 2

    run(main)


def test_base_model_requests_go_to_least_loaded() -> None:
    async def main() -> None:
        ctl = make(cap=4, spill=3)
        await occupy(ctl, "http://a", 2)
        await occupy(ctl, "http://c", 1)
        base = await ctl.acquire(STD, "t")
        assert base.upstream.url == "http://b"
        base2 = await ctl.acquire(STD, "t", affinity=None)
        assert base2.upstream.url in {"http://b", "http://c"}  # both at 1: the rotation decides
        adapter = adapter_preferring("http://a")
        pinned = await ctl.acquire(STD, "t", affinity=adapter)  # a at 2 is below spill: affinity wins
        assert pinned.upstream.url == "http://a" and ctl.spills == 0

    run(main)


def test_exclude_skips_the_preferred_without_counting_a_spill() -> None:
    async def main() -> None:
        ctl = make()
        adapter = adapter_preferring("http://b")
        order = rendezvous_order(adapter, URLS)
        slot = await ctl.acquire(STD, "t", exclude=frozenset({order[0]}), affinity=adapter)
        assert slot.upstream.url == order[1] and ctl.spills == 0

    run(main)


def test_open_breaker_sends_its_adapters_to_their_next_choice_until_it_recovers() -> None:
    async def main() -> None:
        clock = FakeClock()
        ctl = make(breaker=lambda: CircuitBreaker(failure_threshold=1, open_seconds=10, clock=clock))
        on_a = adapter_preferring("http://a")
        on_b, on_c = adapter_preferring("http://b"), adapter_preferring("http://c")
        next_choice = rendezvous_order(on_a, URLS)[1]
        a = ctl.upstreams[0]
        a.breaker.record_failure()
        assert a.breaker.state == "open"
        assert ctl.preferred(on_a) == next_choice and ctl.preferred(on_b) == "http://b"
        moved = await ctl.acquire(STD, "t", affinity=on_a)
        assert moved.upstream.url == next_choice and ctl.spills == 0  # unhealthy is not busy
        assert (await ctl.acquire(STD, "t", affinity=on_b)).upstream.url == "http://b"
        assert (await ctl.acquire(STD, "t", affinity=on_c)).upstream.url == "http://c"
        clock.advance(10)  # half-open: the adapter's next request is a's probe
        probe = await ctl.acquire(STD, "t", affinity=on_a)
        assert probe.upstream is a and a.breaker.state == "half_open"
        assert ctl.preferred(on_a) == next_choice  # the one probe place is taken
        a.breaker.record_success()
        probe.release()
        assert ctl.preferred(on_a) == "http://a"
        assert (await ctl.acquire(STD, "t", affinity=on_a)).upstream is a
        for upstream in ctl.upstreams:
            upstream.breaker.record_failure()
        assert ctl.preferred(on_a) is None

    run(main)


def test_queued_waiter_gets_its_preferred_upstream_when_it_frees() -> None:
    async def main() -> None:
        ctl = make(cap=1, spill=None)
        adapter = adapter_preferring("http://b")
        held = {url: (await occupy(ctl, url, 1))[0] for url in URLS}
        waiter = asyncio.create_task(ctl.acquire(STD, "t", affinity=adapter))
        await settle()
        assert not waiter.done() and ctl.queue_depths()["standard"] == 1
        held["http://b"].release()
        slot = await asyncio.wait_for(waiter, 1)
        assert slot.upstream.url == "http://b" and slot.wait_s >= 0 and ctl.spills == 0

    run(main)


def test_queued_waiters_keep_band_and_turn_order_over_affinity() -> None:
    async def main() -> None:
        ctl = make(cap=1, spill=None)
        held = {url: (await occupy(ctl, url, 1))[0] for url in URLS}
        wants_a, wants_b = adapter_preferring("http://a"), adapter_preferring("http://b")
        std = asyncio.create_task(ctl.acquire(STD, "x", affinity=wants_b))
        await settle()
        crit = asyncio.create_task(ctl.acquire(CRIT, "y", affinity=wants_a))
        await settle()
        assert ctl.queue_depths() == {"critical": 1, "standard": 1, "sheddable": 0}
        # b frees: the critical waiter is first in line, so it takes b although it wants a (a spill) ...
        held["http://b"].release()
        await settle()
        assert crit.done() and crit.result().upstream.url == "http://b" and not std.done()
        assert ctl.spills == 1
        # ... and the standard one, which wanted b, takes the next free slot wherever it is.
        held["http://c"].release()
        slot = await asyncio.wait_for(std, 1)
        assert slot.upstream.url == "http://c" and ctl.spills == 2

    run(main)


def test_refusal_memo_does_not_block_other_affinities_or_excludes() -> None:
    async def main() -> None:
        urls = ("http://a", "http://b")
        ctl = make(urls=urls, cap=1, spill=None)
        held = {url: (await occupy(ctl, url, 1))[0] for url in urls}
        not_a, not_b = frozenset({"http://a"}), frozenset({"http://b"})
        wants_a = adapter_preferring("http://a", TWO)
        blocked = asyncio.create_task(ctl.acquire(CRIT, "t", exclude=not_a, affinity=wants_a))
        await settle()
        wanting_b = [adapter_preferring("http://b", urls, skip=i) for i in range(2)]
        others = [
            asyncio.create_task(ctl.acquire(STD, f"u{i}", exclude=not_b, affinity=key))
            for i, key in enumerate(wanting_b)
        ]
        await settle()
        held["http://a"].release()  # only the first waiter that may use a can have it
        await settle()
        assert not blocked.done() and others[0].done() and not others[1].done()
        assert others[0].result().upstream.url == "http://a"
        others[0].result().release()
        assert (await asyncio.wait_for(others[1], 1)).upstream.url == "http://a"
        held["http://b"].release()
        assert (await asyncio.wait_for(blocked, 1)).upstream.url == "http://b"

    run(main)


@pytest.mark.parametrize("cap", [1, 3])
def test_every_slot_is_used_whatever_the_affinity(cap: int) -> None:
    async def main() -> None:
        ctl = make(cap=cap, spill=None)
        wanted = adapter_preferring("http://a")
        slots = [await ctl.acquire(STD, "t", affinity=wanted) for _ in range(cap * len(URLS))]
        assert ctl.inflight() == dict.fromkeys(URLS, cap)  # spill fills every replica before queueing
        assert sum(s.upstream.url == "http://a" for s in slots) == cap
        assert ctl.spills == cap * (len(URLS) - 1)
        for slot in slots:
            slot.release()

    run(main)


# ---------------------------------------------------------------- routing on the engines' reported load


def engine_mode(
    urls: tuple[str, ...] = ("http://a", "http://b"), cap: int = 64, spill: int = 48
) -> AdmissionController:
    ctl = make(urls=urls, cap=cap, spill=spill)
    ctl.reconfigure(cap, 16, 5.0, spill, load_source="engine", balance_factor=1.2)
    return ctl


TWO = ("http://a", "http://b")


def two_engines() -> tuple[AdmissionController, FakeClock, list[Upstream]]:
    """Engines a and b in engine mode, on a fake clock (for fresh load reports)."""
    ctl = engine_mode(TWO)
    clock = FakeClock()
    ctl._clock = clock
    return ctl, clock, ctl.upstreams


def test_engine_load_header_parses_and_refuses_what_it_cannot_read() -> None:
    load = EngineLoad.parse("running=3, waiting=11, pool=0.42, future=x", 5.0)
    assert load == EngineLoad(3, 11, 5.0)
    for bad in ("", "running=3", "running=-1, waiting=2", "running=a, waiting=2", "garbage"):
        assert EngineLoad.parse(bad, 0.0) is None


def test_a_replica_sees_what_other_replicas_put_on_an_engine() -> None:
    async def main() -> None:
        clock = FakeClock()
        for source, expected in (("local", "http://a"), ("engine", "http://b")):
            ctl = engine_mode()
            ctl._clock = clock
            ctl.load_source = source
            a, b = ctl.upstreams
            a.reported = EngineLoad(running=30, waiting=20, at=clock())  # another gateway's requests
            b.reported = EngineLoad(running=1, waiting=0, at=clock())
            base = await ctl.acquire(STD, "t")  # no affinity: the least loaded
            adapter = await ctl.acquire(STD, "t", affinity=adapter_preferring("http://a", ("http://a", "http://b")))
            assert (base.upstream.url, adapter.upstream.url) == (expected, expected), source
            if source == "engine":
                # A stale report counts for nothing: only this replica's own requests are left.
                clock.advance(10)
                assert a.load(clock()) == a.inflight and b.load(clock()) == b.inflight
            base.release()
            adapter.release()

    run(main)


def test_a_finished_request_leaves_the_reports_made_while_it_ran() -> None:
    async def main() -> None:
        ctl, clock, (a, _) = two_engines()
        a.reported = EngineLoad(running=2, waiting=1, at=clock())  # made before the next request was sent
        clock.advance(1)
        old = await ctl.acquire(STD, "t", exclude=frozenset({"http://b"}))
        old.release()
        assert a.reported == EngineLoad(2, 1, clock() - 1)  # it could not have counted that request
        slots = [await ctl.acquire(STD, "t", exclude=frozenset({"http://b"})) for _ in range(4)]
        clock.advance(0.5)
        a.reported = EngineLoad(running=3, waiting=1, at=clock())  # e.g. the X-Loragate-Load of their answers
        for slot, expected in zip(slots, [(2, 1), (1, 1), (0, 1), (0, 0)], strict=True):
            slot.release()
            assert (a.reported.running, a.reported.waiting) == expected
        assert a.load(clock()) == 0

    run(main)


def test_bounded_loads_split_a_skewed_adapter_stream_and_keep_adapters_together() -> None:
    async def main() -> None:
        urls = ("http://a", "http://b")
        hot = adapter_preferring("http://a", TWO)
        keys = [hot] * 6 + [adapter_preferring(u, urls, skip=i) for i in range(1, 3) for u in urls]  # 60% hot
        stream = [keys[i % len(keys)] for i in range(60)]
        shares = {}
        for source in ("local", "engine"):
            ctl = engine_mode(urls)
            ctl.load_source = source
            for key in stream + stream:  # the replica's recent history: which adapters are hot
                (await ctl.acquire(STD, "t", affinity=key)).release()
            slots = [await ctl.acquire(STD, "t", affinity=key) for key in stream]  # all held: pure placement
            counts = Counter(s.upstream.url for s in slots)
            shares[source] = max(counts.values()) / len(slots)
            # Each cold adapter stays on one upstream (moving it would cost a load for one request); only the
            # hot one, with many requests in flight, is split.
            for key in set(stream) - {hot}:
                assert len({s.upstream.url for s, k in zip(slots, stream, strict=True) if k == key}) == 1
            for slot in slots:
                slot.release()
        assert shares["local"] >= 0.7  # spill_inflight alone: the hot adapter's engine takes its whole share
        assert shares["engine"] <= 0.6  # bounded loads: at most balance_factor x the mean

    run(main)


def test_the_gateway_reads_engine_loads_from_answers_and_get_load() -> None:
    from gateway.app import build_app
    from gateway.policy import parse_policy
    from gateway.ratelimit import MemoryRateLimiter

    from gateway_testing import asgi
    from mock_upstream import MockUpstream
    from policies import ADMIN, bearer, policy_yaml, tenant_yaml

    policy = parse_policy(policy_yaml(tenant_yaml("acme", "k", '["*"]')))

    async def main(url: str, mock: MockUpstream) -> None:
        app = build_app(policy, [url], MemoryRateLimiter())
        async with asgi(app) as gw:
            fleet = app.state.gateway.fleet
            [upstream] = fleet.admission.upstreams
            mock.behavior.load = (7, 3, ("a1",))
            resp = await gw.post("/v1/completions", json={"prompt": "hi"}, headers=bearer("k"))
            assert resp.status_code == 200
            # From X-Loragate-Load, less the request that answer counted, which has ended since.
            assert (upstream.reported.running, upstream.reported.waiting) == (6, 3)
            mock.behavior.load = (0, 12, ("a1", "a2"))
            await fleet.poll_loads()  # what the background loop does every second
            assert (upstream.reported.running, upstream.reported.waiting) == (0, 12)
            assert upstream.on_device == frozenset({"a1", "a2"}) and upstream.device_slots == 8
            [state] = (await gw.get("/admin/policy", headers=ADMIN)).json()["routing"]["upstreams"]
            assert state["reported"] == {"running": 0, "waiting": 12} and state["load"] == 12
            mock.behavior.load = None  # an engine without /load keeps its last report
            await fleet.poll_loads()
            assert upstream.reported.waiting == 12

    with MockUpstream() as mock:
        asyncio.run(main(mock.url, mock))


def test_a_cold_adapter_moves_only_to_an_engine_that_has_it() -> None:
    async def main() -> None:
        ctl, clock, (a, b) = two_engines()
        cold = adapter_preferring("http://a", TWO)
        a.reported = EngineLoad(running=8, waiting=0, at=clock())  # over the bound (b idle), not past 1.5x
        b.reported = EngineLoad(running=2, waiting=0, at=clock())
        first = await ctl.acquire(STD, "t", affinity=cold)
        assert first.upstream is a  # one request of it: not worth a load on b
        b.on_device = frozenset({cold})  # b reports it resident: moving costs nothing now
        second = await ctl.acquire(STD, "t", affinity=cold)
        assert second.upstream is b
        first.release()
        second.release()

    run(main)


def test_a_cold_adapter_resident_nowhere_goes_to_the_first_engine_with_a_free_device_slot() -> None:
    async def main() -> None:
        ctl, clock, (a, b) = two_engines()
        for u in (a, b):
            u.reported = EngineLoad(running=1, waiting=0, at=clock())
            u.device_slots = 2
        a.on_device = frozenset({"x", "y"})  # its preferred engine's device is full of other adapters
        cold = adapter_preferring("http://a", TWO)
        first = await ctl.acquire(STD, "t", affinity=cold)
        assert first.upstream is b  # a load on b evicts nothing
        assert cold in b.on_device  # counted there until b's next report
        other = adapter_preferring("http://a", TWO, skip=1)
        a.on_device = frozenset({"x"})  # a slot free on a: the preferred engine again
        second = await ctl.acquire(STD, "t", affinity=other)
        assert second.upstream is a
        a.device_slots = b.device_slots = None  # engines that do not report their slots: preferred, as before
        a.on_device = frozenset({"x", "y"})
        third = await ctl.acquire(STD, "t", affinity=adapter_preferring("http://a", TWO, skip=2))
        assert third.upstream is a and a.on_device == frozenset({"x", "y"})  # and no guess that nothing corrects
        for slot in (first, second, third):
            slot.release()

    run(main)


def test_a_cold_adapter_stays_on_the_engine_it_was_moved_to() -> None:
    async def main() -> None:
        ctl, clock, (a, b) = two_engines()
        cold = adapter_preferring("http://a", TWO)
        a.reported = EngineLoad(running=0, waiting=0, at=clock())  # its preferred engine is idle ...
        b.reported = EngineLoad(running=1, waiting=0, at=clock())
        b.on_device = frozenset({cold})  # ... but a spill moved it to b and a has evicted it since
        slot = await ctl.acquire(STD, "t", affinity=cold)
        assert slot.upstream is b  # no load on the way back
        slot.release()
        a.on_device = frozenset({cold})  # resident on both: its preferred engine
        slot = await ctl.acquire(STD, "t", affinity=cold)
        assert slot.upstream is a
        slot.release()

    run(main)


def test_local_load_source_keeps_no_residency_guess() -> None:
    async def main() -> None:
        ctl = make(urls=("http://a", "http://b"))
        cold = adapter_preferring("http://a", ("http://a", "http://b"))
        slot = await ctl.acquire(STD, "t", affinity=cold)
        assert slot.upstream.url == "http://a" and slot.upstream.on_device == frozenset()
        slot.release()

    run(main)
