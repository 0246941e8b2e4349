"""The Redis connection both shared gateway states use: rate limits (gateway/redis_limiter.py) and
what the replicas share (gateway/fleet_store.py).

No client-side retries and short socket timeouts, so a refused connection fails at once and a stalled one
after SOCKET_TIMEOUT_S: a dead Redis costs a request at most that long, and never hangs it. Callers decide
what a failure means (`ratelimit.on_redis_error`, rollbacks kept locally until Redis is back).
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

SOCKET_TIMEOUT_S = 0.5
UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)  # what an unreachable Redis raises


def redis_client(url: str) -> aioredis.Redis:
    """A client for `url` with the bounds above; responses decoded to str."""
    return aioredis.Redis.from_url(
        url,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=SOCKET_TIMEOUT_S,
        retry=Retry(NoBackoff(), 0),
        decode_responses=True,
    )
