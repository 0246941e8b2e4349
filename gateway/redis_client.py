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

So a stall costs the calls already in flight one timeout, then one call per interval. BASE_INTERVAL_S is
half a socket timeout: a blip (one lost connection, a slow fork) leaves Redis out only briefly; at
MAX_INTERVAL_S a long outage costs one call a timeout every ~5 s. The breaker guards `execute_command`
(plain commands, PING, scripts: EVALSHA and SCRIPT LOAD run through it) and pipelines' `execute`; pub/sub
and MONITOR, unused here, are not guarded.

Waiting for traffic to find Redis back would leave it out for up to MAX_INTERVAL_S after it answers again
(with `on_redis_error: closed`, refusing requests all that time), so a breaker that knows its Redis
(`breaker_for` gives it `pinger(url)`) also probes it in the background while open: one asyncio task,
started when it opens, PINGs Redis every PING_INTERVAL_S on a connection of its own (opened for that PING
and closed after it, never one of the clients' pooled ones), and closes the breaker as soon as a PING is
answered; the task ends once the breaker is closed. One PING at a time, each bounded by PING_TIMEOUT_S: a
frozen Redis holds one waiting socket, never a pile of them, and the PING in flight when it thaws is
answered at once. Calls are skipped, and probe at the end of each interval, exactly as above.

The task runs on the event loop of the call that opened the breaker. A breaker is shared by the process's
event loops (tests run several), so a call skipped on another loop starts the task again there once its
loop has stopped (`asyncio.run` cancels it on the way out); `stop_probes` cancels it at an app's shutdown
(gateway/app.py). A breaker without `ping` (made by hand, as tests do on their own clock) only moves with
its calls, and so does one opened outside a running loop until a call from one comes.

After an outage a client's first call that gets through drops its pool's idle connections: those opened
before a Redis restart are dead, and a call failing on one ("Connection closed by server") would open the
breaker again with Redis back (each client has its own pool, all share the breaker).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Literal, NoReturn, TypeVar

import anyio
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.connection import Connection, ConnectionPool, parse_url
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
# The background probe (module docstring): how often an open breaker PINGs Redis, at most. It bounds how long
# Redis stays skipped once it answers again; each PING costs one connection attempt, so a short one is cheap.
PING_INTERVAL_S = 0.1
# How long one PING (connect and handshake included) may take: a Redis slower than an ordinary call may be
# does not count as back. A frozen Redis keeps one PING waiting this long, then the next one goes out.
PING_TIMEOUT_S = SOCKET_TIMEOUT_S

BreakerState = Literal["closed", "open", "half_open"]
T = TypeVar("T")


class RedisSkipped(RedisConnectionError):
    """Raised instead of calling Redis while its breaker is open: Redis is treated as unreachable."""


UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)  # what an unreachable Redis raises


class RedisBreaker:
    """The circuit breaker of one Redis (the module docstring says how it moves). `clock`: seconds,
    time.monotonic unless a test moves it by hand. `ping`: the background probe while open (`pinger`; it
    must bound its own duration), one call every `ping_interval_s` at most; None: none."""

    def __init__(
        self,
        name: str = "redis",
        *,
        base_interval_s: float = BASE_INTERVAL_S,
        max_interval_s: float = MAX_INTERVAL_S,
        probe_lost_s: float = PROBE_LOST_S,
        clock: Callable[[], float] = time.monotonic,
        ping: Callable[[], Awaitable[object]] | None = None,
        ping_interval_s: float = PING_INTERVAL_S,
    ) -> None:
        if not 0 < base_interval_s <= max_interval_s:
            raise ValueError(
                f"need 0 < base_interval_s <= max_interval_s, got {base_interval_s!r} and {max_interval_s!r}"
            )
        if probe_lost_s <= 0:
            raise ValueError(f"probe_lost_s must be positive, got {probe_lost_s!r}")
        if ping_interval_s <= 0:
            raise ValueError(f"ping_interval_s must be positive, got {ping_interval_s!r}")
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
        self.ping = ping
        self.ping_interval_s = ping_interval_s
        self.pings = 0  # background PINGs sent, since start
        self._pinger: asyncio.Task[None] | None = None  # the background probe's task while open
        self._ping_error = ""

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

    @property
    def pinging(self) -> bool:
        """The background probe's task is running (on whichever event loop)."""
        task = self._pinger
        return task is not None and not task.done()

    def describe(self) -> dict[str, Any]:
        """For GET /admin/policy: the state, the seconds until a call may probe, the counts, the background
        probe (null for a breaker without one)."""
        now = self._clock()
        until = self._open_until
        return {
            "state": self.state,
            "retry_in_s": round(max(0.0, until - now), 3) if until is not None else None,
            "failures": self.failures,
            "skipped": self.skipped,
            "last_error": self._last_error or None,
            "background_probe": None
            if self.ping is None
            else {"running": self.pinging, "pings": self.pings, "last_error": self._ping_error or None},
        }

    # ---- one call ----

    def admit(self) -> bool:
        """Before a call: False for an ordinary call, True for the half-open probe; raises RedisSkipped
        while open (and while another call is the probe)."""
        until = self._open_until
        if until is None:
            return False
        self._start_pinging()  # the loop that ran it may be gone (module docstring)
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
        if probe:
            self._close("a call")

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
        self._start_pinging()

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

    async def stop_pinging(self) -> None:
        """Cancel the background probe (at shutdown). A later skipped call starts it again while open."""
        task, self._pinger = self._pinger, None
        if task is None or task.done():
            return
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        loop = task.get_loop()
        if loop is running:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        elif not loop.is_closed():
            loop.call_soon_threadsafe(task.cancel)  # another thread's loop: cancelled there

    def _close(self, by: str) -> None:
        self._probe_at = None
        if self._open_until is not None:
            logger.warning(
                "%s reachable again after %.1f s (%s answered; %d calls skipped so far)",
                self.name,
                self._clock() - self._opened_at,
                by,
                self.skipped,
            )
        self._open_until = None
        self.failures = 0
        self.interval_s = 0.0

    def _start_pinging(self) -> None:
        """While open with a `ping`: make sure the background probe runs, here unless it runs on another
        live event loop (another thread's)."""
        if self.ping is None or self._open_until is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop to run it on: the next call from one starts it
        task = self._pinger
        if task is not None and not task.done():
            if task.get_loop() is loop or task.get_loop().is_running():
                return
        self._pinger = loop.create_task(self._pinging(), name=f"{self.name}: background probe")

    async def _pinging(self) -> None:
        """The background probe: PING until one is answered (the breaker closes) or the breaker closes
        otherwise; one at a time, the next no sooner than `ping_interval_s` after the last went out."""
        ping = self.ping
        assert ping is not None
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        try:
            while self._open_until is not None and self._pinger is me:
                sent = loop.time()
                self.pings += 1
                try:
                    await ping()
                except ResponseError:
                    pass  # an error reply: Redis is there
                except Exception as exc:  # still unreachable (anything else must not end the probing either)
                    self._ping_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                    await asyncio.sleep(max(0.0, sent + self.ping_interval_s - loop.time()))
                    continue
                self._close("a background PING")
                return
        finally:
            if self._pinger is me:
                self._pinger = None

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
    """The process's breaker for the Redis at `url` (made on first use), probing it in the background while
    open."""
    breaker = _BREAKERS.get(url)
    if breaker is None:
        breaker = _BREAKERS[url] = RedisBreaker(f"Redis {_redacted(url)}", ping=pinger(url))
    return breaker


def pinger(url: str, timeout_s: float = PING_TIMEOUT_S) -> Callable[[], Awaitable[None]]:
    """The background probe of the Redis at `url`: one PING on a connection opened for it (AUTH, TLS and the
    database as the URL says) and closed after it, none of a client's pooled ones; all of it within
    `timeout_s`. Raises what an unreachable Redis raises, or ResponseError for an error reply."""
    options: dict[str, Any] = dict(parse_url(url))
    connection_class = options.pop("connection_class", Connection)
    options.pop("max_connections", None)  # the pool's, not a connection's
    options.update(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))

    async def ping() -> None:
        connection = connection_class(**options)
        try:
            with anyio.fail_after(timeout_s):
                await connection.connect()
                await connection.send_command("PING")
                await connection.read_response()
        finally:
            await connection.disconnect(nowait=True)

    return ping


async def stop_probes(breakers: Iterable[RedisBreaker]) -> None:
    """Cancel these breakers' background probes (an app's shutdown: gateway/app.py)."""
    for breaker in breakers:
        await breaker.stop_pinging()


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
