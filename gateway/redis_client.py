"""The Redis connection of the gateway's shared state: rate limits (gateway/redis_limiter.py), what the
replicas share (gateway/fleet_store.py), and whatever else is built on `redis_client`.

No client-side retries and short socket timeouts, so a refused connection fails at once and a stalled one
after SOCKET_TIMEOUT_S: a dead Redis costs a request at most that long, and never hangs it. Callers decide
what a failure means (`ratelimit.on_redis_error`, rollbacks kept locally until Redis is back).

A stalled Redis (frozen, or a network that drops packets) would still cost every call its own timeout, so
every client `redis_client` makes goes through a `RedisBreaker`, one per Redis URL per process (the
limiter's and the fleet store's clients share it):

- closed: calls go to Redis. A timeout or connection error opens the breaker.
- open: for `interval` seconds every call raises `RedisSkipped` at once, without touching the network;
  callers treat it like any unreachable Redis (it is a redis ConnectionError, in UNREACHABLE).
- half_open: when the interval is over, one call goes through as a probe while the others are still
  skipped. Redis answering (even with an error reply) closes the breaker; a timeout or connection error
  opens it again with the interval doubled, from BASE_INTERVAL_S up to MAX_INTERVAL_S.

So a stall costs the calls already in flight one timeout, then one probe per interval. BASE_INTERVAL_S is
half a socket timeout: a blip (one lost connection, a slow fork) leaves Redis out only briefly.
MAX_INTERVAL_S bounds how long limits stay local (with `on_redis_error: open`, unlimited) after Redis is
back, and how late the fleet's state is shared again; at that cap a long outage costs one request a
timeout every ~5 s. The breaker guards `execute_command` (plain commands, PING, scripts: EVALSHA and
SCRIPT LOAD run through it) and pipelines' `execute`; pub/sub and MONITOR, unused here, are not guarded.

After an outage a client's first call that gets through drops its pool's idle connections: those opened
before a Redis restart are dead, and a probe failing on one ("Connection closed by server") would keep the
breaker open for another interval with Redis back (each client has its own pool, all share the breaker).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, Literal, NoReturn, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.connection import ConnectionPool
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

logger = logging.getLogger(__name__)

SOCKET_TIMEOUT_S = 0.5
# Opening a connection may take longer than a command: a burst of requests at start (50 at once in
# tests/gateway/test_gateway_ratelimit.py) opens that many connections at once, and their handshakes queue on
# the event loop. A frozen Redis still completes the TCP handshake (the kernel does), so a stall is caught by
# SOCKET_TIMEOUT_S on the first read either way; this bound only matters for an unreachable host.
CONNECT_TIMEOUT_S = 2.0
BASE_INTERVAL_S = 0.25  # how long Redis is skipped after a first failure
MAX_INTERVAL_S = 5.0  # the cap of the doubling interval
PROBE_LOST_S = 4 * SOCKET_TIMEOUT_S  # a probe not reported by then (its event loop died) gives its place back

BreakerState = Literal["closed", "open", "half_open"]
T = TypeVar("T")


class RedisSkipped(RedisConnectionError):
    """Raised instead of calling Redis while its breaker is open: Redis is treated as unreachable."""


UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)  # what an unreachable Redis raises


class RedisBreaker:
    """The circuit breaker of one Redis (the module docstring says how it moves). `clock`: seconds,
    time.monotonic unless a test moves it by hand."""

    def __init__(
        self,
        name: str = "redis",
        *,
        base_interval_s: float = BASE_INTERVAL_S,
        max_interval_s: float = MAX_INTERVAL_S,
        probe_lost_s: float = PROBE_LOST_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < base_interval_s <= max_interval_s:
            raise ValueError(
                f"need 0 < base_interval_s <= max_interval_s, got {base_interval_s!r} and {max_interval_s!r}"
            )
        if probe_lost_s <= 0:
            raise ValueError(f"probe_lost_s must be positive, got {probe_lost_s!r}")
        self.name = name  # for logs only: a URL may hold a password
        self.base_interval_s = base_interval_s
        self.max_interval_s = max_interval_s
        self.probe_lost_s = probe_lost_s
        self._clock = clock
        self.failures = 0  # consecutive openings (0: closed); the interval doubles with each
        self.skipped = 0  # calls answered RedisSkipped without trying Redis, since start
        self.outages = 0  # times it opened from closed, since start
        self.interval_s = 0.0  # of the current opening
        self._open_until: float | None = None  # None: closed
        self._opened_at = 0.0  # when the current run of failures began
        self._probe_at: float | None = None  # when the probe in flight went out
        self._last_error = ""

    # ---- reading ----

    @property
    def state(self) -> BreakerState:
        if self._open_until is None:
            return "closed"
        if self._clock() < self._open_until or self._probing():
            return "open"
        return "half_open"

    @property
    def is_open(self) -> bool:
        """True unless closed: Redis is skipped, or is being probed."""
        return self._open_until is not None

    def describe(self) -> dict[str, Any]:
        """For GET /admin/policy: the state, the seconds until the next probe, the counts."""
        now = self._clock()
        until = self._open_until
        return {
            "state": self.state,
            "retry_in_s": round(max(0.0, until - now), 3) if until is not None else None,
            "failures": self.failures,
            "skipped": self.skipped,
            "last_error": self._last_error or None,
        }

    # ---- one call ----

    def admit(self) -> bool:
        """Before a call: False for an ordinary call, True for the half-open probe; raises RedisSkipped
        while open (and while another call is the probe)."""
        until = self._open_until
        if until is None:
            return False
        now = self._clock()
        if now < until:
            self._skip(f"for another {until - now:.2f} s")
        if self._probing(now):
            self._skip("while a probe call is in flight")
        self._probe_at = now
        return True

    def answered(self, probe: bool) -> None:
        """Redis answered (an error reply included). A probe closes the breaker; an ordinary call that
        started before the breaker opened changes nothing (the probe decides)."""
        if not probe:
            return
        self._probe_at = None
        if self._open_until is not None:
            logger.warning(
                "%s reachable again after %.1f s (%d calls skipped so far)",
                self.name,
                self._clock() - self._opened_at,
                self.skipped,
            )
        self._open_until = None
        self.failures = 0
        self.interval_s = 0.0

    def failed(self, probe: bool, exc: BaseException) -> None:
        """A timeout or connection error. Opens a closed breaker and reopens after a failed probe (the
        interval doubled); calls that started before the breaker opened and fail late change nothing, so
        one stall that times out many calls at once counts once."""
        if probe:
            self._probe_at = None
        elif self._open_until is not None:
            return
        now = self._clock()
        if self.failures == 0:
            self._opened_at = now
            self.outages += 1
        self.failures += 1
        self.interval_s = min(self.max_interval_s, self.base_interval_s * 2 ** (self.failures - 1))
        self._open_until = now + self.interval_s
        self._last_error = f"{type(exc).__name__}: {exc}"
        log = logger.warning if self.failures == 1 else logger.info
        log("%s unreachable (%s): skipping it for %.2f s", self.name, self._last_error, self.interval_s)

    def abandon(self, probe: bool) -> None:
        """The call ended without an answer either way (cancelled, or refused before it was sent): a
        probe gives its place back."""
        if probe:
            self._probe_at = None

    async def call(self, run: Callable[[], Awaitable[T]]) -> T:
        """`run()` under the breaker: skipped while open, its outcome recorded."""
        probe = self.admit()
        try:
            result = await run()
        except RedisSkipped:
            self.abandon(probe)  # a nested guard's skip says nothing new about Redis
            raise
        except ResponseError:
            self.answered(probe)  # an error reply (NOSCRIPT, WRONGTYPE, ...): Redis is there
            raise
        except UNREACHABLE as exc:
            self.failed(probe, exc)
            raise
        except BaseException:
            self.abandon(probe)
            raise
        self.answered(probe)
        return result

    def _probing(self, now: float | None = None) -> bool:
        at = self._probe_at
        return at is not None and (self._clock() if now is None else now) - at < self.probe_lost_s

    def _skip(self, why: str) -> NoReturn:
        self.skipped += 1
        raise RedisSkipped(
            f"{self.name} skipped: its circuit breaker is open {why} "
            f"({self.failures} failed attempt(s) in a row; last: {self._last_error})"
        )


_BREAKERS: dict[str, RedisBreaker] = {}


def breaker_for(url: str) -> RedisBreaker:
    """The process's breaker for the Redis at `url` (made on first use)."""
    breaker = _BREAKERS.get(url)
    if breaker is None:
        breaker = _BREAKERS[url] = RedisBreaker(f"Redis {_redacted(url)}")
    return breaker


def breakers_of(*users: object) -> list[RedisBreaker]:
    """The distinct breakers behind these objects' `breaker` attributes (a RedisRateLimiter, a
    RedisFleetStore; others have none), for metrics."""
    found: dict[int, RedisBreaker] = {}
    for user in users:
        breaker = getattr(user, "breaker", None)
        if isinstance(breaker, RedisBreaker):
            found[id(breaker)] = breaker
    return list(found.values())


def _redacted(url: str) -> str:
    """`url` without its credentials, for logs."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    authority, slash, path = rest.partition("/")
    return f"{scheme}://{authority.rpartition('@')[2]}{slash}{path}"


class _PoolFreshness:
    """How far one connection pool's idle connections are known good: the breaker's `outages` when they
    were last dropped, and a lock that holds the pool's other callers back while they are."""

    def __init__(self) -> None:
        self.outages = 0
        self.lock = asyncio.Lock()


_POOLS: weakref.WeakKeyDictionary[ConnectionPool, _PoolFreshness] = weakref.WeakKeyDictionary()


async def _drop_stale(pool: ConnectionPool, breaker: RedisBreaker) -> None:
    """Once per outage of `breaker`, close `pool`'s idle connections (they may predate a restart). Every
    call through the pool passes here first, so none takes a connection while they are being closed."""
    fresh = _POOLS.get(pool)
    if fresh is None:
        fresh = _POOLS[pool] = _PoolFreshness()
    if fresh.outages == breaker.outages and not fresh.lock.locked():
        return
    async with fresh.lock:
        if fresh.outages == breaker.outages:
            return
        fresh.outages = breaker.outages
        try:
            await pool.disconnect(inuse_connections=False)
        except Exception as exc:  # a socket that would not close cleanly is dropped all the same
            logger.debug("%s: closing idle connections: %s", breaker.name, exc)


class BreakerRedis(aioredis.Redis):
    """A redis.asyncio client whose every command, script and pipeline goes through `breaker`."""

    breaker: RedisBreaker

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        # Scripts land here too: AsyncScript.__call__ sends EVALSHA (and SCRIPT LOAD after NOSCRIPT).
        run: Callable[..., Awaitable[Any]] = super().execute_command  # redis-py's own is untyped

        async def send() -> Any:
            await _drop_stale(self.connection_pool, self.breaker)
            return await run(*args, **options)

        return await self.breaker.call(send)

    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> BreakerPipeline:
        pipe = BreakerPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)
        pipe.breaker = self.breaker
        return pipe

    def client(self) -> BreakerRedis:
        single = BreakerRedis(connection_pool=self.connection_pool, single_connection_client=True)
        single.breaker = self.breaker
        return single


class BreakerPipeline(Pipeline):
    """A pipeline whose round trips go through `breaker`: `execute`, and commands sent at once while
    WATCHing (queued commands wait for `execute`)."""

    breaker: RedisBreaker
    _sending = False  # inside execute: its own immediate commands (SCRIPT LOAD) are part of that call

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        if not self.command_stack and not self.watching:
            return []  # nothing to send: no round trip, nothing to skip

        async def send() -> list[Any]:
            await _drop_stale(self.connection_pool, self.breaker)
            self._sending = True
            try:
                return await super(BreakerPipeline, self).execute(raise_on_error)
            finally:
                self._sending = False

        return await self.breaker.call(send)

    async def immediate_execute_command(self, *args: Any, **options: Any) -> Any:
        run: Callable[..., Awaitable[Any]] = super().immediate_execute_command  # untyped in redis-py
        if self._sending:
            return await run(*args, **options)

        async def send() -> Any:
            await _drop_stale(self.connection_pool, self.breaker)
            return await run(*args, **options)

        return await self.breaker.call(send)


def redis_client(url: str, breaker: RedisBreaker | None = None) -> BreakerRedis:
    """A client for `url` with the bounds above, behind the process's breaker for `url` (or `breaker`);
    responses decoded to str."""
    client = BreakerRedis.from_url(
        url,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        retry=Retry(NoBackoff(), 0),
        decode_responses=True,
    )
    assert isinstance(client, BreakerRedis)  # from_url builds `cls`
    client.breaker = breaker if breaker is not None else breaker_for(url)
    return client
