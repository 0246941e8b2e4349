"""Rate limits against a real redis-server: GCRA bursts, token reservations, atomicity across coroutines and
OS processes, and what happens when Redis goes away. The in-memory limiter runs on a fake clock."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from gateway.policy import Limits, parse_policy
from gateway.ratelimit import Decision, MemoryRateLimiter, RateLimiter, RateLimiterUnavailable
from gateway.redis_limiter import RedisRateLimiter
from gateway.serving import make_limiter

from fake_clock import FakeClock
from redis_server import RedisServer, redis_server_fixture, redis_url_fixture

REPO = Path(__file__).resolve().parents[2]

redis_url = redis_url_fixture()  # one server for the module
redis_server = redis_server_fixture(scope="function")  # a private one, for the test that stops it


def limits(rps: float, burst: int, tpm: int = 10**9) -> Limits:
    return Limits(requests_per_second=rps, burst=burst, tokens_per_minute=tpm)


@dataclass
class Rig:
    limiter: RateLimiter
    advance: Callable[[float], Awaitable[None]]  # let time pass: fake clock or a real sleep


@contextlib.asynccontextmanager
async def open_rig(kind: str, url: str) -> AsyncIterator[Rig]:
    if kind == "memory":
        clock = FakeClock()

        async def advance(seconds: float) -> None:
            clock.now += seconds

        yield Rig(MemoryRateLimiter(clock), advance)
        return
    limiter = RedisRateLimiter(url, on_error="closed", prefix=f"test:{uuid.uuid4().hex}:")

    async def sleep(seconds: float) -> None:
        await asyncio.sleep(seconds + 0.01)  # + slack: the event loop may wake a hair early

    try:
        yield Rig(limiter, sleep)
    finally:
        await limiter.aclose()


@pytest.fixture(params=["memory", "redis"])
def rig(request: pytest.FixtureRequest, redis_url: str) -> Callable[[], contextlib.AbstractAsyncContextManager[Rig]]:
    return lambda: open_rig(request.param, redis_url)


def test_burst_then_rate(rig: Callable[[], contextlib.AbstractAsyncContextManager[Rig]]) -> None:
    async def scenario() -> tuple[list[Decision], Decision, Decision, Decision]:
        async with rig() as r:
            lim = limits(rps=5, burst=10)
            burst = [(await r.limiter.acquire("t", lim, 1))[0] for _ in range(10)]
            refused = (await r.limiter.acquire("t", lim, 1))[0]
            await r.advance(refused.retry_after_s)
            again = (await r.limiter.acquire("t", lim, 1))[0]
            after = (await r.limiter.acquire("t", lim, 1))[0]
            return burst, refused, again, after

    burst, refused, again, after = asyncio.run(scenario())
    assert [d.allowed for d in burst] == [True] * 10
    assert [d.remaining for d in burst] == list(range(9, -1, -1))
    assert all(d.limit == 10 for d in burst)
    assert 1.8 < burst[-1].reset_s <= 2.0 + 1e-9  # 10 emission intervals of 0.2 s to refill
    assert (refused.allowed, refused.reason, refused.remaining) == (False, "rate_limited", 0)
    assert 0 < refused.retry_after_s <= 0.2 + 1e-6
    assert again.allowed  # waiting retry_after is enough
    assert (after.allowed, after.reason) == (False, "rate_limited")  # ... for one request, not a new burst
    assert 0.15 < after.retry_after_s <= 0.2 + 1e-6


def test_idle_time_does_not_bank_more_than_a_burst(
    rig: Callable[[], contextlib.AbstractAsyncContextManager[Rig]],
) -> None:
    async def scenario() -> list[bool]:
        async with rig() as r:
            lim = limits(rps=50, burst=5)  # full again 0.1 s after a burst
            await r.limiter.acquire("t", lim, 1)
            await r.advance(0.3)  # idle three times longer than needed
            return [(await r.limiter.acquire("t", lim, 1))[0].allowed for _ in range(8)]

    assert asyncio.run(scenario()) == [True] * 5 + [False] * 3


def test_tokens_reserve_and_reconcile(rig: Callable[[], contextlib.AbstractAsyncContextManager[Rig]]) -> None:
    async def scenario() -> list[Decision]:
        async with rig() as r:
            lim = limits(rps=100, burst=100, tpm=1000)  # refills 16.7 tokens/s
            first, reservation = await r.limiter.acquire("t", lim, 600)
            assert reservation is not None and reservation.tokens == 600
            second, none = await r.limiter.acquire("t", lim, 600)
            assert none is None
            await r.limiter.reconcile(reservation, used_tokens=100)  # 500 back: ~900 left
            third, _ = await r.limiter.acquire("t", lim, 600)
            fourth, _ = await r.limiter.acquire("t", lim, 400)  # ~300 left
            too_big, _ = await r.limiter.acquire("t", lim, 1001)
            return [first, second, third, fourth, too_big]

    first, second, third, fourth, too_big = asyncio.run(scenario())
    assert first.allowed and third.allowed
    assert (second.allowed, second.reason) == (False, "tokens_exhausted")
    assert 11.5 < second.retry_after_s <= 12.0 + 1e-6  # (600 - 400) tokens at 1000/60 per s
    assert (fourth.allowed, fourth.reason) == (False, "tokens_exhausted")
    assert 5.5 < fourth.retry_after_s <= 6.0 + 1e-6  # (400 - 300) / (1000/60)
    assert (too_big.allowed, too_big.reason, too_big.retry_after_s) == (False, "tokens_exhausted", 60.0)
    assert second.remaining > 0  # the request bucket was not the problem


def test_reconcile_debits_overuse(rig: Callable[[], contextlib.AbstractAsyncContextManager[Rig]]) -> None:
    async def scenario() -> tuple[bool, bool]:
        async with rig() as r:
            lim = limits(rps=100, burst=100, tpm=1000)
            _, reservation = await r.limiter.acquire("t", lim, 100)
            assert reservation is not None
            await r.limiter.reconcile(reservation, used_tokens=400)  # 300 over: 600 left
            over = (await r.limiter.acquire("t", lim, 610))[0]
            exact = (await r.limiter.acquire("t", lim, 600))[0]
            return over.allowed, exact.allowed

    assert asyncio.run(scenario()) == (False, True)


def test_reconcile_never_credits_above_capacity() -> None:
    async def scenario() -> tuple[bool, bool]:
        clock = FakeClock()
        limiter = MemoryRateLimiter(clock)
        lim = limits(rps=100, burst=100, tpm=1000)
        _, reservation = await limiter.acquire("t", lim, 100)
        assert reservation is not None
        clock.now += 60  # refilled to capacity meanwhile
        await limiter.reconcile(reservation, used_tokens=0)  # the 100 back must not overflow
        full = (await limiter.acquire("t", lim, 1000))[0]
        one_more = (await limiter.acquire("t", lim, 1))[0]
        return full.allowed, one_more.allowed

    assert asyncio.run(scenario()) == (True, False)


# (delay before, tokens, reconcile the first reservation with this many used tokens before acquiring)
SCRIPT: list[tuple[float, int, int | None]] = [
    (0, 100, None),
    (0, 200, None),
    (0, 250, None),
    (0, 10, None),
    (0.3, 100, None),
    (0, 40, None),
    (0, 10, None),
    (0.25, 90, 20),
    (0, 10, None),
]
EXPECTED = [
    (True, None),
    (True, None),
    (True, None),
    (False, "rate_limited"),
    (False, "tokens_exhausted"),
    (True, None),
    (False, "rate_limited"),
    (True, None),
    (False, "tokens_exhausted"),
]


def test_memory_and_redis_agree(redis_url: str) -> None:
    """The same script through both limiters. Redis runs on real time, so its run records when each step really
    happened (a slow machine oversleeps) and the in-memory limiter replays the script at those instants on a fake
    clock. Every refusal waits >= 0.2 s, so the few ms a Redis round trip takes cannot flip a decision."""

    async def play(limiter: RateLimiter, at: Callable[[int], Awaitable[None]]) -> list[Decision]:
        lim = limits(rps=4, burst=3, tpm=600)
        decisions, reservations = [], []
        for i, (_, tokens, used) in enumerate(SCRIPT):
            await at(i)
            if used is not None:
                await limiter.reconcile(reservations[0], used)
            decision, reservation = await limiter.acquire("t", lim, tokens)
            decisions.append(decision)
            reservations += [reservation] if reservation else []
        return decisions

    async def play_redis() -> tuple[list[Decision], list[float]]:
        limiter = RedisRateLimiter(redis_url, on_error="closed", prefix=f"test:{uuid.uuid4().hex}:")
        instants: list[float] = []

        async def at(i: int) -> None:
            if SCRIPT[i][0]:
                await asyncio.sleep(SCRIPT[i][0] + 0.01)  # + slack: the event loop may wake a hair early
            instants.append(time.monotonic())

        try:
            return await play(limiter, at), [t - instants[0] for t in instants]
        finally:
            await limiter.aclose()

    shared, instants = asyncio.run(play_redis())
    clock = FakeClock()
    start = clock.now

    async def replay(i: int) -> None:
        clock.now = start + instants[i]

    memory = asyncio.run(play(MemoryRateLimiter(clock), replay))
    assert [(d.allowed, d.reason) for d in memory] == EXPECTED
    for m, s in zip(memory, shared, strict=True):
        assert (s.allowed, s.reason, s.remaining, s.limit) == (m.allowed, m.reason, m.remaining, m.limit)
        assert s.retry_after_s == pytest.approx(m.retry_after_s, abs=0.05)
        assert s.reset_s == pytest.approx(m.reset_s, abs=0.05)


def test_concurrent_acquires_cannot_overrun(rig: Callable[[], contextlib.AbstractAsyncContextManager[Rig]]) -> None:
    async def scenario() -> tuple[list[Decision], list[Decision]]:
        async with rig() as r:
            tok = await asyncio.gather(
                *(r.limiter.acquire("tok", limits(1000, 1000, tpm=1000), 100) for _ in range(50))
            )
            req = await asyncio.gather(*(r.limiter.acquire("req", limits(1, 10), 1) for _ in range(50)))
            return [d for d, _ in tok], [d for d, _ in req]

    tok, req = asyncio.run(scenario())
    assert sum(d.allowed for d in tok) == 10
    assert {d.reason for d in tok if not d.allowed} == {"tokens_exhausted"}
    assert sum(d.allowed for d in req) == 10
    assert {d.reason for d in req if not d.allowed} == {"rate_limited"}


# A separate OS process hammering the limiter. It duck-types Limits so it does not import gateway.policy
# (and torch with it): three workers start in well under a second.
WORKER = """
import asyncio, json, sys, time
from types import SimpleNamespace
from gateway.redis_limiter import RedisRateLimiter

async def main(url, prefix, tenant, rps, burst, start_at, stop_at):
    lim = SimpleNamespace(requests_per_second=rps, burst=burst, tokens_per_minute=10**9)
    limiter = RedisRateLimiter(url, on_error="closed", prefix=prefix)
    assert await limiter.healthy()
    await asyncio.sleep(max(0.0, start_at - time.time()))
    admitted = attempts = 0
    first = time.time()
    while time.time() < stop_at:
        decision, _ = await limiter.acquire(tenant, lim, 1)
        admitted += decision.allowed
        attempts += 1
        await asyncio.sleep(0.002)
    last = time.time()
    await limiter.aclose()
    sys.stdout.write(json.dumps(dict(admitted=admitted, attempts=attempts, first=first, last=last)))

a = sys.argv[1:]
asyncio.run(main(a[0], a[1], a[2], float(a[3]), int(a[4]), float(a[5]), float(a[6])))
"""


def test_two_processes_share_one_limit(redis_url: str) -> None:
    rps, burst, window_s = 20.0, 10, 1.5
    prefix = f"test:{uuid.uuid4().hex}:"
    start_at = time.time() + 1.0  # all workers connected and waiting by then
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [redis_url, prefix, "<tenant>", str(rps), str(burst), str(start_at), str(start_at + window_s)]
    # Two processes share tenant "shared"; a third, alone on "single", is the one-process reference.
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, *[tenant if a == "<tenant>" else a for a in args]],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for tenant in ("shared", "shared", "single")
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err.decode()
        results.append(json.loads(out))

    def total_and_span(group: list[dict[str, float]]) -> tuple[int, float]:
        return (int(sum(r["admitted"] for r in group)), max(r["last"] for r in group) - min(r["first"] for r in group))

    shared, shared_span = total_and_span(results[:2])
    single, single_span = total_and_span(results[2:])
    assert all(r["attempts"] > 100 for r in results)  # each really hammered
    assert results[0]["admitted"] > 0 and results[1]["admitted"] > 0
    for total, span in ((shared, shared_span), (single, single_span)):
        assert total <= burst + rps * span + 2  # GCRA's bound over the span, + boundary slack
        assert total >= burst + rps * span * 0.6
    assert abs(shared - single) <= 3 + rps * abs(shared_span - single_span)


def test_keys_expire_when_idle(redis_url: str) -> None:
    limiter = RedisRateLimiter(redis_url, prefix=f"test:{uuid.uuid4().hex}:")

    async def scenario() -> None:
        await limiter.acquire("idle", limits(rps=5, burst=10, tpm=60000), 600)  # 0.2 s and 0.6 s to refill
        await limiter.aclose()

    asyncio.run(scenario())
    req_key, tok_key = limiter.keys("idle")
    assert req_key == f"{limiter.prefix}idle:req" and tok_key == f"{limiter.prefix}idle:tok"
    client = redis.Redis.from_url(redis_url)
    try:
        assert 0 < client.pttl(req_key) <= 200
        assert 0 < client.pttl(tok_key) <= 600
        time.sleep(0.7)
        assert client.exists(req_key, tok_key) == 0
    finally:
        client.close()


def test_redis_down(redis_server: RedisServer) -> None:
    lim = limits(rps=5, burst=10, tpm=60000)

    async def scenario() -> None:
        fail_open = RedisRateLimiter(redis_server.url, on_error="open")
        fail_closed = RedisRateLimiter(redis_server.url, on_error="closed")
        assert (await fail_closed.acquire("t", lim, 10))[0].allowed
        assert await fail_open.healthy() and await fail_closed.healthy()

        redis_server.stop()
        decision, reservation = await asyncio.wait_for(fail_open.acquire("t", lim, 10), 3)
        assert decision.allowed and reservation is not None
        assert fail_open.redis_errors == 1
        with pytest.raises(RateLimiterUnavailable):
            await asyncio.wait_for(fail_closed.acquire("t", lim, 10), 3)
        assert fail_closed.redis_errors == 1
        await asyncio.wait_for(fail_closed.reconcile(reservation, 5), 3)  # best effort: logged, not raised
        assert fail_closed.redis_errors == 2
        assert not await asyncio.wait_for(fail_open.healthy(), 3)
        assert not await asyncio.wait_for(fail_closed.healthy(), 3)

        # The same port: the limiter reconnects on its own, once the Redis breaker (open since the first
        # failure: gateway/redis_client.py) lets a probe through.
        redis_server.start()
        deadline = time.monotonic() + 10
        while not await fail_closed.healthy():
            assert time.monotonic() < deadline, "the limiter did not reconnect"
            await asyncio.sleep(0.05)
        assert (await fail_closed.acquire("t", lim, 10))[0].allowed
        assert fail_closed.redis_errors == 2
        await fail_open.aclose()
        await fail_closed.aclose()

    asyncio.run(scenario())


def test_make_limiter_follows_the_policy(redis_url: str) -> None:
    policy = parse_policy("version: 1\nratelimit: {on_redis_error: closed}\n")
    assert isinstance(make_limiter(None, policy), MemoryRateLimiter)

    async def scenario() -> None:
        shared = make_limiter(redis_url, policy)
        assert isinstance(shared, RedisRateLimiter) and shared.on_error == "closed"
        assert await shared.healthy()
        await shared.aclose()

    asyncio.run(scenario())
