"""`VllmAdapters`: catalog adapters fetched into the disk cache (loragate_common/adapter_cache.py) and loaded into vLLM
(vllm_agent/vllm.py) under their ref `ID@N`.

`ensure(ID@N, wanted)` runs one task per id however many requests wait for it: the cache fetches the pinned source
(one download per digest; failures back off as the cache rules), then, holding the id's lock, the agent reads vLLM's
model list (an id vLLM lists is loaded: the agent restarted, or a load timed out on our side but not on vLLM's) and
otherwise asks vLLM to load `<vllm cache dir>/<sha256>`; vLLM's "has already been loaded" counts as loaded. A request
waits at most `load_wait_s`, then gets 503 `adapter_loading` while the task goes on.

What vLLM holds is only known from its answers: every read of its model list also learns the ids it lists from this
cache (their sha256 is the last part of their `root`), and ids it no longer lists, or an unreachable vLLM (it may have
restarted), make the agent check the list again on the id's next ensure; so does an ensure for an id it believes
loaded (the gateway asks only when vLLM did not list the id, or answered that it has no such model). vLLM may read an
adapter's files again after loading it (when it drops it from its CPU cache), so when the cache evicts an entry the
ids loaded from it are unloaded from vLLM; the cache's callback may run in a download thread and is handed to the
event loop. Each id's load, replacement and unload run under the id's lock, and an unload is skipped when the entry
was fetched again meanwhile (its files are back at the same path).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from loragate_common.adapter_cache import AdapterCache, FetchBackoff
from loragate_common.adapter_sources import AllowList, SourceError
from loragate_common.errors import unavailable
from loragate_common.fetched import Wanted, fetch_failed, source_refused, still_loading
from vllm_agent.config import AgentConfig
from vllm_agent.metrics import AgentMetrics
from vllm_agent.vllm import RUNTIME_UPDATING_ENV, VllmClient, VllmRefused, VllmUnavailable

logger = logging.getLogger(__name__)

UNAVAILABLE_RETRY_AFTER_S = 2.0  # vLLM did not answer
REFUSED_RETRY_AFTER_S = 60.0  # vLLM refused the adapter: asking again soon would meet the same answer
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass
class _Lora:
    """An id as vLLM holds it (or refused it): the cache entry it comes from."""

    sha256: str
    loaded: bool
    load_s: float | None = None  # how long vLLM's load took (None: loaded before this agent saw it)
    error: str | None = None  # why the last load failed


class VllmAdapters:
    """The disk cache and what vLLM loaded from it, by id."""

    def __init__(self, config: AgentConfig, vllm: VllmClient, metrics: AgentMetrics) -> None:
        self.config = config
        self.vllm = vllm
        self.metrics = metrics
        self._loop: asyncio.AbstractEventLoop | None = None  # set before the cache may evict while serving
        self.cache = AdapterCache(
            config.cache_dir,
            max_bytes=config.cache_bytes,
            max_adapter_bytes=config.max_adapter_bytes,
            allow=AllowList(config.allow),
            fetch_timeout_s=config.fetch_timeout_s,
            on_evict=self.evicted,
        )
        self._loras: dict[str, _Lora] = {}
        self._pending: dict[str, tuple[asyncio.Future[None], str]] = {}  # id -> its task, the sha256 it wants
        self._locks: dict[str, asyncio.Lock] = {}  # id -> held while vLLM's state of the id is read or changed
        self._tasks: set[asyncio.Task[None]] = set()  # unloads in the background

    async def start(self) -> None:
        """Learn what vLLM already loaded from this cache (an agent restart); a vLLM not up yet is read later."""
        self._loop = asyncio.get_running_loop()
        try:
            await self._listed()
        except (VllmUnavailable, VllmRefused) as exc:
            logger.info("vLLM's adapters not read at start (read on the first ensure): %s", exc)

    async def close(self) -> None:
        """Stop the work in flight (a download thread runs on; the next start removes what it left) and the client."""
        for task in [*self._tasks, *(task for task, _ in self._pending.values())]:
            task.cancel()
        await self.vllm.aclose()

    async def ensure(self, adapter_id: str, wanted: Wanted) -> dict[str, Any]:
        """Make `adapter_id` fetched and loaded into vLLM from `wanted`; its answer card. ApiError: 403, 502 or 503
        (the module says when)."""
        loop = self._loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.load_wait_s
        if self._loaded(adapter_id, wanted.sha256):
            # The gateway asks only when vLLM did not list the id, or answered that it has no such model (it
            # restarted): look at its list again rather than answer from memory.
            with contextlib.suppress(VllmUnavailable, VllmRefused):  # unreachable: the load below says so
                await self._listed()
        while not self._loaded(adapter_id, wanted.sha256):
            pending = self._pending.get(adapter_id)
            if pending is None:
                task = asyncio.ensure_future(self._fetch_and_load(adapter_id, wanted))
                pending = self._pending[adapter_id] = (task, wanted.sha256)
                task.add_done_callback(lambda done: self._settled(adapter_id, done))
            try:  # shield: a request that stops waiting leaves the task to the others
                await asyncio.wait_for(asyncio.shield(pending[0]), timeout=max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise still_loading(adapter_id, wanted) from None
        self.cache.entry(wanted.sha256)  # marks it used: the cache evicts the least recently used first
        entry = self.cache.status_of(wanted.sha256)
        lora = self._loras[adapter_id]
        return {
            "id": adapter_id,
            "sha256": wanted.sha256,
            "state": "loaded",
            "download_s": entry["download_s"] if entry is not None else None,
            "load_s": lora.load_s,
        }

    def cards(self) -> list[dict[str, Any]]:
        """GET /v1/adapters: a card per cache entry and id known for it (id None when no id is)."""
        cards: list[dict[str, Any]] = []
        for entry in self.cache.status():
            sha256 = entry["sha256"]
            names = {name for name, lora in self._loras.items() if lora.sha256 == sha256}
            names |= {name for name, (_, wanted) in self._pending.items() if wanted == sha256}
            ids: list[str | None] = [*sorted(names)] or [None]
            cards += [self._card(name, entry) for name in ids]
        return cards

    def vllm_lost(self) -> None:
        """vLLM did not answer, so it may have restarted without its adapters: check its list on each id's next
        ensure."""
        for lora in self._loras.values():
            lora.loaded = False

    def evicted(self, sha256: str) -> None:
        """The cache's `on_evict`, from any thread: unload the ids loaded from `sha256`, on the event loop."""
        loop = self._loop
        if loop is None:  # evicted before serving: _listed finds vLLM's ids whose files are gone
            return
        try:
            loop.call_soon_threadsafe(self._evicted, sha256)
        except RuntimeError:  # the loop is closed: the agent is stopping
            logger.info("adapter %s evicted while stopping; vLLM keeps what it loaded from it", sha256[:12])

    def _loaded(self, adapter_id: str, sha256: str) -> bool:
        lora = self._loras.get(adapter_id)
        return lora is not None and lora.loaded and lora.sha256 == sha256

    def _settled(self, adapter_id: str, task: asyncio.Future[None]) -> None:
        if self._pending.get(adapter_id, (None, ""))[0] is task:
            del self._pending[adapter_id]
        if not task.cancelled():
            task.exception()  # retrieved: every waiter may have given up already

    async def _fetch_and_load(self, adapter_id: str, wanted: Wanted) -> None:
        self.cache.pin(wanted.sha256)  # not evicted between its download and vLLM's load
        try:
            await self._fetch(adapter_id, wanted)
            async with self._lock(adapter_id):
                await self._load(adapter_id, wanted.sha256)
        finally:
            self.cache.unpin(wanted.sha256)

    async def _fetch(self, adapter_id: str, wanted: Wanted) -> None:
        try:
            await self.cache.ensure(wanted.source, wanted.sha256, wanted.size)
        except FetchBackoff as exc:
            self.metrics.failed(exc.reason)
            if adapter_id not in self._loras:  # its card shows the id beside the failed entry
                self._loras[adapter_id] = _Lora(wanted.sha256, loaded=False, error=str(exc))
            raise fetch_failed(f"adapter {adapter_id!r} ({exc.reason}): {exc}", exc.retry_after_s) from None
        except SourceError as exc:  # refused before anything was fetched: no entry, no card
            self.metrics.failed(exc.reason)
            raise source_refused(adapter_id, exc) from None

    async def _load(self, adapter_id: str, sha256: str) -> None:
        """Under the id's lock: load the id into vLLM from the cache entry `sha256`, unless vLLM has it already."""
        path = self.config.lora_path(sha256)
        try:
            listed = await self._listed()
            if adapter_id in listed:
                root = listed[adapter_id]
                if root is None or self._sha_of(root) in (None, sha256):
                    if root != path:
                        logger.warning("vLLM lists %s from %s, not from %s: taken as loaded", adapter_id, root, path)
                    self._set_loaded(adapter_id, sha256, None)
                    return
                await self.vllm.unload(adapter_id)  # loaded from other content: replaced
                self.metrics.unloads.inc()
            started = time.monotonic()
            loaded_now = await self.vllm.load(adapter_id, path)
        except VllmUnavailable as exc:
            self.vllm_lost()
            self.metrics.failed("vllm_unavailable")
            self._loras.setdefault(adapter_id, _Lora(sha256, loaded=False))  # its card shows the id, on disk
            raise unavailable(
                f"adapter {adapter_id!r}: {exc}", "upstream_unavailable", UNAVAILABLE_RETRY_AFTER_S
            ) from None
        except VllmRefused as exc:
            self.metrics.failed(exc.reason)
            message = self._refusal(adapter_id, path, exc)
            self._loras[adapter_id] = _Lora(sha256, loaded=False, error=message)
            raise fetch_failed(message, REFUSED_RETRY_AFTER_S) from None
        if loaded_now:
            self.metrics.loads.inc()
            self._set_loaded(adapter_id, sha256, time.monotonic() - started)
            logger.info("adapter %s loaded into vLLM from %s", adapter_id, path)
        else:
            self._set_loaded(adapter_id, sha256, None)

    def _refusal(self, adapter_id: str, path: str, exc: VllmRefused) -> str:
        if exc.reason == "runtime_updating_off":
            return (
                f"vLLM at {self.vllm.base_url} cannot load adapters at run time ({exc}): start it with "
                f"{RUNTIME_UPDATING_ENV}=True"
            )
        return f"vLLM refused to load adapter {adapter_id!r} from {path}: {exc}"

    def _set_loaded(self, adapter_id: str, sha256: str, load_s: float | None) -> None:
        lora = self._loras.get(adapter_id)
        if load_s is None and lora is not None and lora.sha256 == sha256:
            load_s = lora.load_s  # the load this agent timed, confirmed again
        self._loras[adapter_id] = _Lora(sha256, loaded=True, load_s=load_s)

    async def _listed(self) -> dict[str, str | None]:
        """vLLM's LoRAs {id: root}. Learns the ids loaded from this cache; ids whose entry is gone are unloaded
        (vLLM could not read their files again); ids it no longer lists are checked again on their next ensure."""
        listed = await self.vllm.loras()
        for name, known in self._loras.items():
            if name not in listed:
                known.loaded = False
        for name, root in listed.items():
            sha256 = self._sha_of(root)
            lora = self._loras.get(name)
            if sha256 is None or (lora is not None and lora.sha256 != sha256):
                continue  # not loaded from this cache, or being replaced under the id's lock
            entry = self.cache.status_of(sha256)
            if entry is None or entry["state"] != "disk":
                self._spawn(self._forget(name, sha256))
            elif lora is None:
                self._loras[name] = _Lora(sha256, loaded=True)
            else:
                lora.loaded, lora.error = True, None
        return listed

    def _sha_of(self, root: str | None) -> str | None:
        """The cache entry a LoRA's `root` names, if it is `<vllm cache dir>/<sha256>`."""
        if root is None:
            return None
        path = PurePosixPath(root)
        return path.name if path.parent == self.config.vllm_dir and _HEX64.fullmatch(path.name) else None

    def _evicted(self, sha256: str) -> None:
        for name in [name for name, lora in self._loras.items() if lora.sha256 == sha256]:
            del self._loras[name]  # an ensure from now on loads it again, after the unload below
            self._spawn(self._forget(name, sha256))

    async def _forget(self, name: str, sha256: str) -> None:
        """Unload `name` if vLLM holds it from the entry `sha256`, which the cache no longer holds."""
        async with self._lock(name):
            lora = self._loras.get(name)
            if (lora is not None and lora.sha256 != sha256) or self.cache.entry(sha256) is not None:
                return  # loaded again from other content, or fetched again: its files are back
            self._loras.pop(name, None)
            try:
                if self._sha_of((await self.vllm.loras()).get(name)) != sha256:
                    return  # vLLM does not hold it from this entry (any more)
                unloaded = await self.vllm.unload(name)
            except (VllmUnavailable, VllmRefused) as exc:
                self.metrics.failed("unload_failed")
                logger.warning("adapter %s: its files left the cache, but unloading it from vLLM failed: %s", name, exc)
                return
        if unloaded:
            self.metrics.unloads.inc()
            logger.info("adapter %s unloaded from vLLM: its files left the cache", name)

    def _lock(self, adapter_id: str) -> asyncio.Lock:
        return self._locks.setdefault(adapter_id, asyncio.Lock())

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _card(self, name: str | None, entry: dict[str, Any]) -> dict[str, Any]:
        lora = self._loras.get(name) if name is not None else None
        state, error = entry["state"], entry["error"]
        if state == "disk" and lora is not None and lora.sha256 == entry["sha256"]:
            if lora.loaded:
                state = "loaded"
            elif lora.error is not None:
                state, error = "failed", lora.error
        return {
            "id": name,
            "object": "adapter",
            "sha256": entry["sha256"],
            "source": entry["source"],
            "state": state,
            "error": error,
            "download_s": entry["download_s"],
            "load_s": lora.load_s if lora is not None and lora.loaded else None,
            "last_used": entry["last_used"],
            "adapter": entry.get("adapter"),
        }
