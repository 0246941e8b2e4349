"""The Redis circuit breaker (gateway/redis_client.py): its states on a hand-moved clock, then in front of a
real Redis that is frozen (SIGSTOP) or gone, for plain commands, scripts, pipelines, the rate limiter and
the fleet store, and in the gateway's metrics; its background probe, which closes it without traffic once
Redis answers again."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families
from redis.exceptions import ResponseError

from gateway.fleet_store import RedisFleetStore
from gateway.policy import Limits
from gateway.ratelimit import RateLimiterUnavailable
from gateway.redis_client import (
    PING_TIMEOUT_S,
    UNREACHABLE,
    RedisBreaker,
    RedisSkipped,
    breaker_for,
    breakers_of,
    pinger,
    redis_client,
    stop_probes,
)
from gateway.redis_limiter import RedisRateLimiter
from gateway.telemetry import GatewayMetrics

from fake_clock import FakeClock
from polling import wait_until
from processes import free_port
from redis_server import RedisServer, ping, redis_server_fixture

redis_server = redis_server_fixture(scope="function")

BOOM = TimeoutError("Timeout reading from socket")


def opened(clock: FakeClock | None = None, **kwargs: Any) -> RedisBreaker:
    """A breaker that has just seen one failure."""
    breaker = RedisBreaker(clock=clock or FakeClock(), **kwargs)
    assert breaker.admit() is False
    breaker.failed(False, BOOM)
    return breaker


def skips(breaker: RedisBreaker) -> bool:
    try:
        breaker.admit()
    except RedisSkipped:
        return True
    return False


# ---- the state machine, on a fake clock -------------------------------------------------------------


def test_closed_admits_and_one_failure_opens() -> None:
    clock = FakeClock()
    breaker = RedisBreaker(clock=clock)
    assert breaker.state == "closed" and not breaker.is_open
    assert breaker.admit() is False  # an ordinary call, not a probe
    breaker.answered(False)
    assert breaker.state == "closed"
    breaker.failed(False, BOOM)
    assert breaker.state == "open" and breaker.is_open and breaker.interval_s == 0.25
    with pytest.raises(RedisSkipped) as raised:
        breaker.admit()
    message = str(raised.value)
    assert "circuit breaker is open" in message and "0.25 s" in message and "TimeoutError" in message
    assert isinstance(raised.value, redis.exceptions.ConnectionError) and isinstance(raised.value, UNREACHABLE)
    assert breaker.skipped == 1


def test_half_open_lets_one_probe_through_and_its_success_closes() -> None:
    clock = FakeClock()
    breaker = opened(clock)
    clock.advance(0.24)
    assert skips(breaker)
    clock.advance(0.01)
    assert breaker.state == "half_open"
    assert breaker.admit() is True  # the probe
    assert breaker.state == "open"  # while it is out, the others are still skipped
    assert skips(breaker) and skips(breaker)
    breaker.answered(True)
    assert breaker.state == "closed" and breaker.failures == 0 and breaker.skipped == 3
    assert breaker.admit() is False


def test_failed_probes_double_the_interval_up_to_the_cap_and_a_success_resets_it() -> None:
    clock = FakeClock()
    breaker = opened(clock)
    intervals = [breaker.interval_s]
    for _ in range(6):
        clock.advance(breaker.interval_s - 0.001)
        assert skips(breaker)  # not a moment early
        clock.advance(0.001)
        assert breaker.admit() is True
        breaker.failed(True, BOOM)
        intervals.append(breaker.interval_s)
    assert intervals == [0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    clock.advance(5.0)
    assert breaker.admit() is True
    breaker.answered(True)
    breaker.failed(False, BOOM)  # the next outage starts from the base interval again
    assert breaker.interval_s == 0.25 and breaker.failures == 1


def test_a_stall_that_fails_many_calls_at_once_counts_once() -> None:
    """Calls already in flight when the breaker opens fail late; they neither extend nor close it."""
    clock = FakeClock()
    breaker = RedisBreaker(clock=clock)
    in_flight = [breaker.admit() for _ in range(8)]
    for probe in in_flight:
        breaker.failed(probe, BOOM)
    assert breaker.failures == 1 and breaker.interval_s == 0.25
    breaker.answered(False)  # a late answer of an ordinary call: the probe decides, not it
    assert breaker.state == "open"
    clock.advance(0.25)
    assert breaker.admit() is True
    breaker.failed(False, BOOM)  # an old call failing while the probe is out
    assert breaker.failures == 1 and breaker.state == "open"


def test_a_probe_that_never_reports_gives_its_place_back() -> None:
    clock = FakeClock()
    breaker = opened(clock, probe_lost_s=2.0)
    clock.advance(0.25)
    assert breaker.admit() is True
    clock.advance(1.9)
    assert skips(breaker)
    clock.advance(0.1)
    assert breaker.admit() is True  # the first one was lost (its event loop went away)
    breaker.abandon(True)  # a cancelled probe gives its place back at once
    assert breaker.admit() is True


def test_call_records_each_outcome() -> None:
    clock = FakeClock()
    breaker = opened(clock)

    async def raising(exc: BaseException) -> None:
        raise exc

    async def scenario() -> None:
        clock.advance(0.25)
        with pytest.raises(ResponseError):
            await breaker.call(lambda: raising(ResponseError("NOSCRIPT")))  # an error reply: Redis is there
        assert breaker.state == "closed"
        with pytest.raises(ConnectionRefusedError):
            await breaker.call(lambda: raising(ConnectionRefusedError(111, "refused")))  # an OSError
        assert breaker.state == "open"
        clock.advance(0.25)
        with pytest.raises(ValueError):
            await breaker.call(lambda: raising(ValueError("encoding")))  # never sent: no verdict
        assert breaker.state == "half_open"
        with pytest.raises(asyncio.CancelledError):
            await breaker.call(lambda: raising(asyncio.CancelledError()))
        assert breaker.state == "half_open"

    asyncio.run(scenario())


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="base_interval_s"):
        RedisBreaker(base_interval_s=0)
    with pytest.raises(ValueError, match="base_interval_s"):
        RedisBreaker(base_interval_s=2, max_interval_s=1)
    with pytest.raises(ValueError, match="probe_lost_s"):
        RedisBreaker(probe_lost_s=0)
    with pytest.raises(ValueError, match="ping_interval_s"):
        RedisBreaker(ping_interval_s=0)


def test_one_breaker_per_url_shared_by_every_client() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    limiter, store = RedisRateLimiter(url), RedisFleetStore(url)
    assert redis_client(url).breaker is breaker_for(url) is limiter.breaker is store.breaker
    assert breakers_of(limiter, store, object()) == [breaker_for(url)]
    assert breaker_for(f"redis://127.0.0.1:{free_port()}/0") is not breaker_for(url)
    assert "secret" not in breaker_for("redis://:secret@127.0.0.1:1/0").name
    assert breaker_for(url).ping is not None  # the process's breakers probe in the background while open


# ---- in front of a real Redis ------------------------------------------------------------------------


def commands_processed(plain: redis.Redis) -> int:
    """Redis's own count of the commands it ran, this INFO call included."""
    return int(plain.info("stats")["total_commands_processed"])


def quiet_count(plain: redis.Redis) -> int:
    """`commands_processed` once nothing but our INFO calls runs (what a frozen Redis had received runs
    after SIGCONT)."""
    previous = commands_processed(plain)
    deadline = time.monotonic() + 5
    while (now := commands_processed(plain)) != previous + 1:
        assert time.monotonic() < deadline, "Redis kept running commands"
        previous = now
        time.sleep(0.05)
    return now


def test_a_frozen_redis_costs_one_timeout_then_calls_skip_without_touching_it(redis_server: RedisServer) -> None:
    clock = FakeClock()
    breaker = RedisBreaker(clock=clock)
    key = f"test:{uuid.uuid4().hex}"

    async def scenario() -> dict[str, Any]:
        client = redis_client(redis_server.url, breaker=breaker)
        other = redis_client(redis_server.url, breaker=breaker)  # another client of the same Redis
        script = client.register_script("return redis.call('INCR', KEYS[1])")
        out: dict[str, Any] = {"first": await script(keys=[key])}
        redis_server.pause()
        try:
            with pytest.raises(redis.exceptions.TimeoutError):  # tried, and waited its socket timeout
                await client.get(key)
            calls: list[Callable[[], Awaitable[Any]]] = [
                lambda: client.get(key),
                lambda: other.ping(),
                lambda: script(keys=[key]),
                lambda: client.pipeline(transaction=False).incr(key).expire(key, 60).execute(),
                lambda: other.pipeline(transaction=True).incr(key).execute(),
            ]
            out["skipped"] = []
            for call in calls:
                try:
                    await call()
                except RedisSkipped as exc:
                    out["skipped"].append(str(exc))
        finally:
            redis_server.resume()
        # Redis answers again, but the breaker still skips until its interval is over: no command sent.
        with redis.Redis(port=redis_server.port) as plain:
            before = quiet_count(plain)
            for call in calls:
                with pytest.raises(RedisSkipped):
                    await call()
            out["sent_while_open"] = commands_processed(plain) - before - 1  # less our own INFO
        clock.advance(0.25)
        out["probe"] = await other.pipeline(transaction=False).incr(key).execute()  # the probe: closes
        out["state"] = breaker.state
        out["after"] = await script(keys=[key])
        await client.aclose()
        await other.aclose()
        return out

    out = asyncio.run(scenario())
    assert out["first"] == 1
    assert len(out["skipped"]) == 5 and all("circuit breaker is open" in m for m in out["skipped"])
    assert breaker.skipped == 10
    assert out["sent_while_open"] == 0
    assert out["probe"] == [2] and out["state"] == "closed" and out["after"] == 3


def test_connections_from_before_a_restart_do_not_fail_the_probe(redis_server: RedisServer) -> None:
    """Each client has its own pool; after an outage, the first call through each drops its idle
    connections, so a probe on a socket the old Redis closed does not keep the breaker open."""
    clock = FakeClock()
    breaker = RedisBreaker(clock=clock)

    async def scenario() -> list[Any]:
        one = redis_client(redis_server.url, breaker=breaker)
        two = redis_client(redis_server.url, breaker=breaker)
        await one.ping()
        await two.ping()  # both pools hold a connection now
        redis_server.stop()
        with pytest.raises(redis.exceptions.ConnectionError):
            await one.ping()
        assert breaker.state == "open"
        redis_server.start()  # a new Redis on the same port
        clock.advance(0.25)
        answers = [await two.ping(), breaker.state, await one.ping(), await two.pipeline().ping().execute()]
        await one.aclose()
        await two.aclose()
        return answers

    assert asyncio.run(scenario()) == [True, "closed", True, [True]]
    assert breaker.failures == 0 and breaker.outages == 1


def test_limiter_and_fleet_store_apply_their_failure_policy_at_once(redis_server: RedisServer) -> None:
    """Fail open admits, fail closed refuses, health is False, the fleet store raises "unreachable": all
    without a call to Redis while the breaker is open."""
    limits = Limits(requests_per_second=5, burst=10, tokens_per_minute=60000)
    clock = FakeClock()
    breaker = RedisBreaker(clock=clock)

    async def scenario() -> None:
        fail_open = RedisRateLimiter(redis_server.url, on_error="open", prefix=f"test:{uuid.uuid4().hex}:")
        fail_closed = RedisRateLimiter(redis_server.url, on_error="closed", prefix=fail_open.prefix)
        store = RedisFleetStore(redis_server.url)
        for user in (fail_open, fail_closed, store):
            user._redis.breaker = breaker  # one hand-clocked breaker for all three (as one URL shares one)
        assert (await fail_open.acquire("t", limits, 10))[0].remaining == 9
        redis_server.pause()
        try:
            assert (await fail_open.acquire("t", limits, 10))[0].allowed  # the one timeout
            assert breaker.state == "open"
            before = breaker.skipped
            decision, reservation = await fail_open.acquire("t", limits, 10)
            assert decision.allowed and reservation is not None
            with pytest.raises(RateLimiterUnavailable, match="circuit breaker is open"):
                await fail_closed.acquire("t", limits, 10)
            await fail_closed.reconcile(reservation, 5)  # best effort: not raised
            assert not await fail_open.healthy()
            with pytest.raises(UNREACHABLE):
                await store.read_hash("loragate:overrides")
            with pytest.raises(UNREACHABLE):
                await store.push_log("test:log", "entry", 10)
            assert breaker.skipped - before == 6
            assert fail_open.redis_errors == 2 and fail_closed.redis_errors == 2
        finally:
            redis_server.resume()
        clock.advance(0.25)
        assert await fail_closed.healthy()  # the probe
        assert breaker.state == "closed"
        assert (await fail_closed.acquire("t", limits, 10))[0].allowed
        for user in (fail_open, fail_closed, store):
            await user.aclose()

    asyncio.run(scenario())


def test_a_dead_redis_opens_the_shared_breaker() -> None:
    """Connection refused opens it too, and every client of that URL skips."""
    url = f"redis://127.0.0.1:{free_port()}/0"

    async def scenario() -> None:
        client = redis_client(url)
        with pytest.raises(redis.exceptions.ConnectionError) as first:
            await client.ping()
        assert not isinstance(first.value, RedisSkipped)
        other = aioredis.Redis.from_url(url)  # a plain client is not behind the breaker
        with pytest.raises(redis.exceptions.ConnectionError) as plain:
            await other.ping()
        assert not isinstance(plain.value, RedisSkipped)
        await other.aclose()
        await client.aclose()

    asyncio.run(scenario())
    assert breaker_for(url).failures == 1 and breaker_for(url).is_open


def test_metrics_show_the_breaker() -> None:
    clock = FakeClock()
    breaker = RedisBreaker(clock=clock)
    metrics = GatewayMetrics()

    def scrape() -> dict[str, float]:
        text = metrics.render()[0].decode()
        return {
            s.name: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name.startswith("loragate_gateway_redis_")
        }

    metrics.bind(queue_depths=dict, inflight=dict, breaker_states=dict, redis_errors=int)
    assert scrape() == {
        "loragate_gateway_redis_errors_total": 0,
        "loragate_gateway_redis_breaker_open": 0,
        "loragate_gateway_redis_skipped_total": 0,
    }
    metrics.bind(
        queue_depths=dict, inflight=dict, breaker_states=dict, redis_errors=int, redis_breakers=lambda: [breaker]
    )
    breaker.failed(False, BOOM)
    for _ in range(3):
        skips(breaker)
    found = scrape()
    assert found["loragate_gateway_redis_breaker_open"] == 1 and found["loragate_gateway_redis_skipped_total"] == 3
    clock.advance(0.25)
    breaker.answered(breaker.admit())
    assert scrape()["loragate_gateway_redis_breaker_open"] == 0


# ---- the background probe -----------------------------------------------------------------------------


def test_the_background_probe_pings_until_an_answer_closes_the_breaker() -> None:
    """A fake PING: failures keep the breaker open; an error reply is an answer, and closes it; the task
    then ends. It also ends when a call's probe closes the breaker first."""
    clock = FakeClock()
    outcomes: list[BaseException | None] = []

    async def fake_ping() -> None:
        outcome = outcomes.pop(0) if outcomes else ConnectionRefusedError(111, "refused")
        if outcome is not None:
            raise outcome

    breaker = RedisBreaker(clock=clock, ping=fake_ping, ping_interval_s=0.01)

    async def scenario() -> None:
        outcomes.extend([ConnectionRefusedError(111, "refused"), RedisSkipped("no"), ResponseError("LOADING")])
        breaker.failed(False, BOOM)
        assert breaker.pinging
        await wait_until(lambda: not breaker.is_open, what="closed by the third PING")
        assert breaker.pings == 3 and breaker.failures == 0 and breaker.skipped == 0
        await wait_until(lambda: not breaker.pinging, what="the probe's task ended")
        described = breaker.describe()["background_probe"]
        assert described["running"] is False and described["pings"] == 3
        assert "RedisSkipped" in described["last_error"]

        breaker.failed(False, BOOM)  # a new outage: PINGs fail until a call's probe closes the breaker
        await wait_until(lambda: breaker.pings >= 5, what="two more PINGs")
        assert breaker.describe()["background_probe"]["running"] is True
        clock.advance(0.25)
        breaker.answered(breaker.admit())
        await wait_until(lambda: not breaker.pinging, what="the probe's task ended")
        assert breaker.state == "closed"

    asyncio.run(scenario())


def test_the_background_probe_runs_on_a_live_event_loop_and_stops_at_shutdown() -> None:
    """Opened outside a loop, nothing runs; a skipped call starts the probe on its own loop; `asyncio.run`
    cancels it on the way out and the next loop's skipped call starts it again; `stop_probes` cancels it."""
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    breaker = RedisBreaker(ping=pinger(url))
    breaker.failed(False, BOOM)
    assert breaker.is_open and not breaker.pinging

    async def run_a_while() -> None:
        assert skips(breaker)
        assert breaker.pinging
        before = breaker.pings
        await wait_until(lambda: breaker.pings >= before + 2, what="two PINGs")
        assert breaker.is_open and "ConnectionError" in breaker.describe()["background_probe"]["last_error"]

    asyncio.run(run_a_while())
    assert not breaker.pinging  # cancelled with its loop
    asyncio.run(run_a_while())  # started again on another loop

    async def stopped() -> None:
        assert skips(breaker) and breaker.pinging
        await stop_probes([breaker, RedisBreaker()])
        assert not breaker.pinging and breaker.is_open

    asyncio.run(stopped())


def test_without_traffic_the_breaker_closes_soon_after_a_restarted_redis_answers(redis_server: RedisServer) -> None:
    """Redis killed, then started again on its port: no call is made meanwhile, yet the breaker closes
    within half a second of Redis answering the test's own PING, and the pooled connections from before
    the restart are not used."""
    breaker = RedisBreaker(ping=pinger(redis_server.url))

    def restart() -> float:
        redis_server.start()  # returns once Redis answers a PING
        return time.monotonic()

    async def scenario() -> float:
        client = redis_client(redis_server.url, breaker=breaker)
        assert await client.ping()
        redis_server.stop()
        with pytest.raises(redis.exceptions.ConnectionError):
            await client.ping()
        assert breaker.is_open and breaker.pinging
        await asyncio.sleep(1.0)  # no call: only the background probe tries Redis
        assert breaker.is_open and breaker.pings >= 2
        answered = await asyncio.to_thread(restart)
        await wait_until(lambda: not breaker.is_open, what="the breaker closed")
        closed = time.monotonic()
        assert breaker.skipped == 0  # no call got near Redis while it was open
        await wait_until(lambda: not breaker.pinging, what="the probe's task ended")
        assert await client.ping()  # the connection from before the restart was dropped
        await client.aclose()
        return closed - answered

    recovered_s = asyncio.run(scenario())
    assert recovered_s < 0.5, f"the breaker closed {recovered_s:.3f} s after Redis answered"
    assert breaker.failures == 0 and breaker.outages == 1


def test_a_frozen_redis_holds_one_ping_at_a_time_and_the_breaker_closes_soon_after_it_thaws(
    redis_server: RedisServer,
) -> None:
    """SIGSTOP: one call waits its timeout and opens the breaker; the background PINGs go out one at a time,
    each waiting its own timeout (Redis's connection count says so too); after SIGCONT the breaker closes
    within half a second of Redis answering the test's PING, without a call."""
    real = pinger(redis_server.url)
    in_flight = peak = 0

    async def counted_ping() -> None:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            await real()
        finally:
            in_flight -= 1

    breaker = RedisBreaker(ping=counted_ping)

    def thawed() -> float:
        redis_server.resume()
        while not ping(redis_server.port):
            pass
        return time.monotonic()

    async def scenario() -> dict[str, Any]:
        client = redis_client(redis_server.url, breaker=breaker)
        assert await client.ping()
        with redis.Redis(port=redis_server.port) as plain:
            connections = int(plain.info("stats")["total_connections_received"])
        out: dict[str, Any] = {}
        redis_server.pause()
        try:
            with pytest.raises(redis.exceptions.TimeoutError):
                await client.get("key")
            assert breaker.is_open and breaker.pinging
            frozen_at = time.monotonic()
            await asyncio.sleep(2.0)
            out["open"] = breaker.is_open
        finally:
            answered = await asyncio.to_thread(thawed)
        out["frozen_s"] = answered - frozen_at
        await wait_until(lambda: not breaker.is_open, what="the breaker closed")
        out["recovered_s"] = time.monotonic() - answered
        out["pings"] = breaker.pings
        out["skipped"] = breaker.skipped
        await wait_until(lambda: not breaker.pinging, what="the probe's task ended")
        assert await client.get("key") is None
        with redis.Redis(port=redis_server.port) as plain:
            # Those sent while frozen, the test's PING, this client; the thawed Redis has accepted them all
            await wait_until(
                lambda: int(plain.info("stats")["total_connections_received"]) - connections >= out["pings"] + 2,
                what="Redis accepted the connections",
            )
            out["connections"] = int(plain.info("stats")["total_connections_received"]) - connections
        await client.aclose()
        return out

    out = asyncio.run(scenario())
    assert out["open"] and out["skipped"] == 0
    assert peak == 1
    # Each PING while frozen waited its timeout before the next went out: no pile-up.
    assert 2 <= out["pings"] <= out["frozen_s"] / PING_TIMEOUT_S + 2, out
    # No other connection was opened: the PINGs, the test's PING, the plain client, one for the call after.
    assert out["connections"] <= out["pings"] + 3, out
    assert out["recovered_s"] < 0.5, f"the breaker closed {out['recovered_s']:.3f} s after Redis answered"
