"""What the gateway replicas share through Redis, so the fleet acts as one: `FleetStore`.

  rollbacks and rollout control states   one key per rollout definition (gateway/rollout.py, progress.py)
  pooled rollout windows                 per-variant hashes of counts per time slice (gateway/rollout.py)
  operator overrides                     one hash of suspended tenants, drained upstreams (gateway/overrides.py)
  the admin actions' log                 a capped list (gateway/admin.py)

`RedisFleetStore` keeps them in Redis (the connection of gateway/redis_client.py: a dead or stalled
Redis fails a call fast, at once while its breaker is open, and each caller decides what a failure
means). `LocalFleetStore` shares nothing: one replica, or no `--redis`. Rate limits are shared through the
same Redis, by gateway/redis_limiter.py.
"""

from __future__ import annotations

from typing import Protocol

from gateway.redis_client import RedisBreaker, redis_client


def _text(value: bytes | str) -> str:
    assert isinstance(value, str)  # the client decodes every response (gateway/redis_client.py)
    return value


class FleetStore(Protocol):
    """The shared store's operations (the module docstring says who uses which). `shared` False: nothing is."""

    shared: bool

    async def fetch(self, keys: list[str]) -> dict[str, str]: ...
    async def publish(self, key: str, value: str) -> None: ...
    async def clear(self, keys: list[str]) -> None: ...
    async def add_counts(self, counts: dict[str, tuple[dict[str, int], int]]) -> None: ...
    async def read_counts(self, keys: list[str]) -> list[dict[str, str]]: ...
    async def put_newer(self, key: str, value: str, version: int, ttl_s: int) -> None: ...
    async def read_hash(self, key: str) -> dict[str, str]: ...
    async def update_hash(self, key: str, put: dict[str, str], remove: list[str]) -> None: ...
    async def push_log(self, key: str, value: str, keep: int) -> None: ...
    async def read_log(self, key: str, count: int) -> list[str]: ...
    async def aclose(self) -> None: ...


class LocalFleetStore:
    """No sharing: each replica decides for itself, from its own windows."""

    shared = False

    async def fetch(self, keys: list[str]) -> dict[str, str]:
        return {}

    async def publish(self, key: str, value: str) -> None:
        return None

    async def clear(self, keys: list[str]) -> None:
        return None

    async def add_counts(self, counts: dict[str, tuple[dict[str, int], int]]) -> None:
        return None

    async def read_counts(self, keys: list[str]) -> list[dict[str, str]]:
        return [{} for _ in keys]

    async def put_newer(self, key: str, value: str, version: int, ttl_s: int) -> None:
        return None

    async def read_hash(self, key: str) -> dict[str, str]:
        return {}

    async def update_hash(self, key: str, put: dict[str, str], remove: list[str]) -> None:
        return None

    async def push_log(self, key: str, value: str, keep: int) -> None:
        return None

    async def read_log(self, key: str, count: int) -> list[str]:
        return []

    async def aclose(self) -> None:
        return None


class RedisFleetStore:
    """The fleet's shared state in Redis.

    A rollback is one key per rollout definition, written once (SET NX) and kept for a week. A pooled
    window is a hash of Counts fields per variant and time slice, incremented by every replica (HINCRBY)
    and expiring soon after it leaves the window.
    """

    TTL_S = 7 * 24 * 3600
    shared = True

    # KEYS: the control key. ARGV: the JSON value, its version, the TTL. Writes only over an older version.
    _PUT_NEWER = """
local current = redis.call('GET', KEYS[1])
if current then
  local ok, decoded = pcall(cjson.decode, current)
  if ok and tonumber(decoded['version']) >= tonumber(ARGV[2]) then return 0 end
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', tonumber(ARGV[3]))
return 1
"""

    def __init__(self, url: str) -> None:
        self._redis = redis_client(url)
        self._put_newer = self._redis.register_script(self._PUT_NEWER)

    @property
    def breaker(self) -> RedisBreaker:
        """The breaker in front of this store's Redis (shared with every client of the same URL)."""
        return self._redis.breaker

    async def fetch(self, keys: list[str]) -> dict[str, str]:
        values = await self._redis.mget(keys)
        return {k: _text(v) for k, v in zip(keys, values, strict=True) if v is not None}

    async def publish(self, key: str, value: str) -> None:
        await self._redis.set(key, value, ex=self.TTL_S, nx=True)

    async def clear(self, keys: list[str]) -> None:
        if keys:
            await self._redis.delete(*keys)

    async def add_counts(self, counts: dict[str, tuple[dict[str, int], int]]) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for key, (fields, ttl_s) in counts.items():
            for name, delta in fields.items():
                pipe.hincrby(key, name, delta)
            pipe.expire(key, ttl_s)
        await pipe.execute()

    async def read_counts(self, keys: list[str]) -> list[dict[str, str]]:
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
        return [{_text(k): _text(v) for k, v in found.items()} for found in await pipe.execute()]

    async def put_newer(self, key: str, value: str, version: int, ttl_s: int) -> None:
        """Write `value` unless the stored one has `version` or newer (replicas deciding at once agree)."""
        await self._put_newer(keys=[key], args=[value, version, ttl_s])

    async def read_hash(self, key: str) -> dict[str, str]:
        return {_text(k): _text(v) for k, v in (await self._redis.hgetall(key)).items()}

    async def update_hash(self, key: str, put: dict[str, str], remove: list[str]) -> None:
        pipe = self._redis.pipeline(transaction=True)
        for name, value in put.items():
            pipe.hset(key, name, value)
        if remove:
            pipe.hdel(key, *remove)
        await pipe.execute()

    async def push_log(self, key: str, value: str, keep: int) -> None:
        """Prepend `value` to a list that keeps its newest `keep` entries."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.lpush(key, value)
        pipe.ltrim(key, 0, keep - 1)
        await pipe.execute()

    async def read_log(self, key: str, count: int) -> list[str]:
        return [_text(v) for v in await self._redis.lrange(key, 0, count - 1)]

    async def aclose(self) -> None:
        await self._redis.aclose()
