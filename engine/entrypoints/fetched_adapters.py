"""Adapters fetched on their first request: the catalog's `ID@N`, from the source the gateway names.

The gateway resolves a catalog adapter (gateway/adapter_catalog.py) to a version and sends it here as
`X-Adapter-ID: ID@N` with `X-Adapter-Source`, `X-Adapter-SHA256` and optionally `X-Adapter-Size`. If `ID@N`
is not registered, `FetchedAdapters.ensure` has the disk tier (loragate_common/adapter_cache.py) fetch it —
one download however many requests wait for it — then registers it from the cache and the request runs.
A request waits at most `--adapter-load-wait-s`; then it gets 503 `adapter_loading` with Retry-After while
the download goes on. A failed download answers 502 `adapter_fetch_failed` with the reason, and is not
tried again before its backoff has passed. The headers and these answers are loragate_common/fetched.py's, which
the vLLM agent shares.

A weighted mix (loragate_common/adapter_mix.py) names several adapters at once; its catalog parts come with one
`X-Adapter-Part-Sources` header, JSON: [{"ref": "ID@N", "source": ..., "sha256": ..., "size": int | null}, ...], a
catalog part each (`part_sources_from_headers`: as hostile as the single adapter's headers, so bounded in size and
checked field by field, every ref a part of the mix). `ensure_parts` fetches and registers them as single pinned
adapters would be, all at once: the request waits for the slowest within the same bound, and gets 503
`adapter_loading` until every part is ready.

Trust boundary: any caller that can reach the engine may name a source, as any caller may POST
/v1/adapters; what bounds it is the engine's own `--adapter-source-allow` (nothing outside it is ever
fetched, 403 `adapter_source_not_allowed`) and the pinned digest (content that does not match is never
registered). Clients reach engines only through the gateway, which sets these headers itself and never
forwards a client's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from starlette.requests import HTTPConnection

from engine.core.async_engine import AsyncEngine
from loragate_common.adapter_cache import AdapterCache, FetchBackoff
from loragate_common.adapter_ids import split_ref
from loragate_common.adapter_mix import MAX_PARTS, PART_SOURCES_HEADER, MixPart
from loragate_common.adapter_sources import AllowList, SourceError
from loragate_common.errors import ApiError, bad_request, shown
from loragate_common.fetched import MAX_SOURCE_CHARS, Wanted, fetch_failed, source_refused, still_loading

logger = logging.getLogger(__name__)

# A header of MAX_PARTS entries, each a source of the longest allowed length with its ref, digest and size.
MAX_PART_SOURCES_CHARS = MAX_PARTS * (MAX_SOURCE_CHARS + 512)
_PART_SOURCE_KEYS = frozenset(("ref", "source", "sha256", "size"))
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


def part_sources_from_headers(request: HTTPConnection, parts: Sequence[MixPart]) -> dict[str, Wanted]:
    """{part ref: its pinned source} from a mix request's X-Adapter-Part-Sources ({} without it); 400 naming the
    problem when it is malformed, names a ref that is not a part of the mix, or comes with X-Adapter-Source (which
    names one adapter's source, not a mix's)."""
    if request.headers.get("x-adapter-source") is not None:
        raise bad_request(
            f"X-Adapter-Source: names the source of one adapter; the catalog parts of a mix go in {PART_SOURCES_HEADER}"
        )
    values = request.headers.getlist(PART_SOURCES_HEADER.lower())
    if not values:
        return {}
    if len(values) > 1:
        raise bad_request(f"{PART_SOURCES_HEADER}: given more than once")
    if len(values[0]) > MAX_PART_SOURCES_CHARS:
        raise bad_request(f"{PART_SOURCES_HEADER}: longer than {MAX_PART_SOURCES_CHARS} characters")
    try:
        items = json.loads(values[0])
    except (ValueError, RecursionError):
        raise bad_request(f"{PART_SOURCES_HEADER}: not valid JSON") from None
    if not isinstance(items, list) or not 1 <= len(items) <= len(parts):
        raise bad_request(f"{PART_SOURCES_HEADER}: must be a list of 1 to {len(parts)} sources, one per catalog part")
    refs = {part.ref for part in parts}
    wanted: dict[str, Wanted] = {}
    for i, item in enumerate(items):
        ref, source = _part_source(f"{PART_SOURCES_HEADER}[{i}]", item, refs)
        if ref in wanted:
            raise bad_request(f"{PART_SOURCES_HEADER}[{i}].ref: {shown(ref)} is given twice")
        wanted[ref] = source
    return wanted


def _part_source(field: str, item: Any, refs: set[str]) -> tuple[str, Wanted]:
    """One entry of X-Adapter-Part-Sources, checked as wanted_from_headers checks a single adapter's headers."""
    if not isinstance(item, dict):
        raise bad_request(f'{field}: must be an object {{"ref", "source", "sha256", "size"}}')
    unknown = sorted(str(key) for key in item if key not in _PART_SOURCE_KEYS)
    if unknown:
        raise bad_request(f"{field}: unknown field {shown(unknown[0])}")
    ref = item.get("ref")
    if not isinstance(ref, str) or (parsed := split_ref(ref)) is None or parsed[1] is None:
        raise bad_request(f"{field}.ref: must be a catalog version `ID@N`")
    if ref not in refs:
        raise bad_request(f"{field}.ref: {shown(ref)} is not a part of the mix")
    source = item.get("source")
    if not isinstance(source, str) or not source.strip() or len(source) > MAX_SOURCE_CHARS:
        raise bad_request(f"{field}.source: must be a source URI of 1 to {MAX_SOURCE_CHARS} characters")
    sha256 = item.get("sha256")
    if not isinstance(sha256, str) or _SHA256_RE.fullmatch(sha256.strip().lower()) is None:
        raise bad_request(f"{field}.sha256: must be the content's sha256 (64 hex digits)")
    size = item.get("size")
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
        raise bad_request(f"{field}.size: must be a number of bytes or null")
    return ref, Wanted(source.strip(), sha256.strip().lower(), size)


class FetchedAdapters:
    """Registers fetched adapters under their catalog ids; pins a cache entry while requests use it."""

    def __init__(self, engine: AsyncEngine, store: AdapterCache | None, load_wait_s: float) -> None:
        self.engine = engine
        self.store = store
        self.load_wait_s = load_wait_s
        self._lock = threading.Lock()  # `evicted` may run in the disk tier's download thread
        self._digests: dict[str, str] = {}  # registered id -> the sha256 it was registered from
        self._registering: dict[str, asyncio.Future[None]] = {}  # id -> its registration in progress
        self.last_used: dict[str, float] = {}  # id -> time.time() of its last request

    @classmethod
    def from_config(cls, engine: AsyncEngine) -> FetchedAdapters:
        config = engine.engine.config
        fetched = cls(engine, None, config.adapter_load_wait_s)
        if config.adapter_cache_dir is not None:
            fetched.store = AdapterCache(
                Path(config.adapter_cache_dir),
                max_bytes=config.adapter_cache_mb << 20,
                max_adapter_bytes=config.adapter_max_mb << 20,
                allow=AllowList(config.adapter_source_allow),
                fetch_timeout_s=config.adapter_fetch_timeout_s,
                on_evict=fetched.evicted,
            )
        return fetched

    def touch(self, adapter_id: str | None) -> None:
        if adapter_id is not None:
            self.last_used[adapter_id] = time.time()

    async def ensure(self, adapter_id: str, wanted: Wanted) -> str:
        """Make `adapter_id` registered with `wanted`'s content (fetching it if needed) and pin its cache
        entry; the sha256 to unpin when the request is done. ApiError: 403, 502 or 503 (see the module)."""
        if self.store is None:
            raise ApiError(
                403,
                "adapter_source_not_allowed",
                "this engine fetches no adapters: start it with --adapter-cache-dir and --adapter-source-allow",
            )
        self.store.pin(wanted.sha256)
        self.store.entry(wanted.sha256)  # marks it used: the disk tier evicts the least recently used first
        try:
            await asyncio.wait_for(self._ready(adapter_id, wanted), timeout=self.load_wait_s)
        except asyncio.TimeoutError:
            self.store.unpin(wanted.sha256)
            raise still_loading(adapter_id, wanted) from None
        except BaseException:
            self.store.unpin(wanted.sha256)
            raise
        return wanted.sha256

    async def ensure_parts(self, wanted: dict[str, Wanted]) -> list[str]:
        """`ensure` for each catalog part of a mix ({ref: its source}), all at once: the sha256s pinned (each to
        release when the request ends), or the first part's error, with nothing left pinned."""
        results = await asyncio.gather(*(self.ensure(ref, w) for ref, w in wanted.items()), return_exceptions=True)
        pinned = [result for result in results if isinstance(result, str)]
        failed = [result for result in results if isinstance(result, BaseException)]
        if failed:
            for sha256 in pinned:
                self.release(sha256)
            raise failed[0]
        return pinned

    def release(self, sha256: str) -> None:
        if self.store is not None:
            self.store.unpin(sha256)

    async def _ready(self, adapter_id: str, wanted: Wanted) -> None:
        while self._digest(adapter_id) != wanted.sha256 or self.engine.engine.adapter_residence(adapter_id) is None:
            pending = self._registering.get(adapter_id)
            if pending is None:
                pending = asyncio.ensure_future(self._fetch_and_register(adapter_id, wanted))
                self._registering[adapter_id] = pending
                pending.add_done_callback(lambda _: self._registering.pop(adapter_id, None))
            await asyncio.shield(pending)  # a waiter that gives up leaves the download to the others

    def _digest(self, adapter_id: str) -> str | None:
        with self._lock:
            return self._digests.get(adapter_id)

    async def _fetch_and_register(self, adapter_id: str, wanted: Wanted) -> None:
        assert self.store is not None
        try:
            path = await self.store.ensure(wanted.source, wanted.sha256, wanted.size)
        except FetchBackoff as exc:
            raise fetch_failed(f"adapter {adapter_id!r} ({exc.reason}): {exc}", exc.retry_after_s) from None
        except SourceError as exc:
            raise source_refused(adapter_id, exc) from None
        try:
            await self.engine.register_cached(adapter_id, path)
        except ValueError as exc:  # AdapterError: the files are no LoRA adapter for this base model
            raise fetch_failed(f"adapter {adapter_id!r} from {wanted.source} is unusable: {exc}", 60.0) from None
        with self._lock:
            self._digests[adapter_id] = wanted.sha256
        logger.info("adapter %s fetched from %s (sha256 %s)", adapter_id, wanted.source, wanted.sha256[:12])

    def evicted(self, sha256: str) -> None:
        """The disk tier removed an entry (never one in use): unregister the ids registered from it. Called
        from the event loop's thread or the download thread, so it only queues the unload."""
        with self._lock:
            ids = [adapter_id for adapter_id, digest in self._digests.items() if digest == sha256]
            for adapter_id in ids:
                del self._digests[adapter_id]
        for adapter_id in ids:
            with contextlib.suppress(KeyError):  # unloaded meanwhile (DELETE /v1/adapters)
                self.engine.forget_adapter(adapter_id)
            logger.info("adapter %s unregistered: its files left the disk cache", adapter_id)

    def sources(self) -> dict[str, str]:
        """{sha256: source} of the disk cache's entries, read once for a whole GET /v1/adapters."""
        return {e["sha256"]: e["source"] for e in self.store.status()} if self.store is not None else {}

    def card_fields(self, adapter_id: str, sources: dict[str, str]) -> dict[str, Any]:
        """What GET /v1/adapters adds to a registered adapter's card (`sources`: from `sources()`)."""
        sha256 = self._digest(adapter_id)
        source = sources.get(sha256) if sha256 is not None else None
        return {"source": source, "sha256": sha256, "last_used": self.last_used.get(adapter_id)}

    def pending_cards(self, base_model: str) -> list[dict[str, Any]]:
        """GET /v1/adapters' cards for cache entries no id is registered from: downloading, failed, or on disk
        from before a restart (their ids are learnt from the next request that names them)."""
        if self.store is None:
            return []
        with self._lock:
            registered = set(self._digests.values())
        return [
            {
                "id": None,
                "object": "adapter",
                "parent": base_model,
                "state": entry["state"],
                "residence": entry["state"],
                "source": entry.get("source"),
                "sha256": entry["sha256"],
                "error": entry.get("error"),
                "last_used": entry.get("last_used"),
                "loads": 0,
                "evictions": 0,
                "adapter": entry.get("adapter"),
            }
            for entry in self.store.status()
            if entry["sha256"] not in registered
        ]
