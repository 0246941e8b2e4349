"""Where the adapter catalog (gateway/adapter_catalog.py) is kept: `CatalogStore`.

The catalog is one hash, a field per adapter id holding that id's JSON. `RedisCatalogStore` keeps it in Redis
(the key `loragate:adapters`, through the connection and circuit breaker of gateway/redis_client.py), shared by
every gateway replica; `LocalCatalogStore` keeps it in this process (no `--redis`).

A change is a function of the whole hash (it needs it: versions are numbered per id, quotas sum over a
tenant's ids) that returns the fields to write (None: delete the field) and a result. `transact` applies it
atomically: in Redis under WATCH/MULTI, run again on the fresh hash when another replica wrote in between, so
two replicas registering the same id at once get distinct versions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from redis.exceptions import WatchError

from gateway.redis_client import RedisBreaker, redis_client

CATALOG_KEY = "loragate:adapters"
MAX_TRIES = 32  # a change retried this often without getting through is refused (CatalogBusy)

T = TypeVar("T")
Writes = dict[str, str | None]  # field -> new JSON, or None to delete it
Change = Callable[[dict[str, str]], tuple[Writes, T]]


class CatalogBusy(RuntimeError):
    """Other writers kept changing the catalog: the change did not get through (try again)."""


def _text(value: bytes | str) -> str:
    assert isinstance(value, str)  # the client decodes every response (gateway/redis_client.py)
    return value


def _applied(fields: dict[str, str], writes: Writes) -> dict[str, str]:
    out = dict(fields)
    for name, value in writes.items():
        if value is None:
            out.pop(name, None)
        else:
            out[name] = value
    return out


class CatalogStore(Protocol):
    """The catalog's hash: read whole, changed atomically. `shared`: other replicas see it."""

    shared: bool

    async def read(self) -> dict[str, str]: ...
    async def transact(self, change: Change[T]) -> tuple[dict[str, str], T]: ...
    async def aclose(self) -> None: ...


class LocalCatalogStore:
    """The catalog in this process only."""

    shared = False

    def __init__(self) -> None:
        self._fields: dict[str, str] = {}

    async def read(self) -> dict[str, str]:
        return dict(self._fields)

    async def transact(self, change: Change[T]) -> tuple[dict[str, str], T]:
        # No await between reading and writing: no other task can change the hash in between.
        writes, result = change(dict(self._fields))
        self._fields = _applied(self._fields, writes)
        return dict(self._fields), result

    async def aclose(self) -> None:
        return None


class RedisCatalogStore:
    """The catalog in one Redis hash, shared by the replicas."""

    shared = True

    def __init__(self, url: str, key: str = CATALOG_KEY) -> None:
        self._redis = redis_client(url)
        self.key = key

    @property
    def breaker(self) -> RedisBreaker:
        return self._redis.breaker

    async def read(self) -> dict[str, str]:
        return {_text(k): _text(v) for k, v in (await self._redis.hgetall(self.key)).items()}

    async def transact(self, change: Change[T]) -> tuple[dict[str, str], T]:
        """Run `change` on the hash as it is and write its fields, unless another writer changed the hash
        meanwhile (then run it again on the new hash). An exception from `change` writes nothing."""
        for _ in range(MAX_TRIES):
            async with self._redis.pipeline(transaction=True) as pipe:
                await pipe.watch(self.key)
                found = await pipe.hgetall(self.key)
                current = {_text(k): _text(v) for k, v in found.items()}
                writes, result = change(dict(current))
                if not writes:
                    return current, result
                pipe.multi()  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
                for name, value in writes.items():
                    if value is None:
                        pipe.hdel(self.key, name)
                    else:
                        pipe.hset(self.key, name, value)
                try:
                    await pipe.execute()
                except WatchError:
                    continue
                return _applied(current, writes), result
        raise CatalogBusy(f"the adapter catalog changed {MAX_TRIES} times during one change; try again")

    async def aclose(self) -> None:
        await self._redis.aclose()
