"""The disk cache of fetched adapters: a content-addressed, size-bounded LRU cache on local disk. The engine's disk
tier (engine/entrypoints/fetched_adapters.py) and the vLLM agent (vllm_agent/loader.py) keep their adapters in it.

An entry is `<root>/<sha256>/` holding the two adapter files and meta.json (source, sha256, size,
fetched_at). It is written into a `<root>/.tmp-*` directory by loragate_common/adapter_sources.py's `fetch`,
fsynced and published by os.rename, so a crash leaves a complete entry or a temp dir that the next start
removes. Downloads are single-flight per sha256 and run in worker threads; a failed one is not tried again
before its backoff (1 s doubling to 60 s) has passed. Entries in use are pinned and never evicted; before
an entry is published, least recently used unpinned ones are removed until the cache fits `max_bytes`.

Thread-safe: ensure() runs on the event loop, downloads in worker threads, and the engine may call
entry(), pin(), unpin() and status() from its own thread. `on_evict` may be called from a download thread.
Torch-free: the vLLM agent runs in the gateway's image.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from loragate_common.adapter_kinds import summarize_dir
from loragate_common.adapter_sources import ADAPTER_FILES, AllowList, Fetched, Source, SourceError, fetch, parse_source

logger = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"
META = "meta.json"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_MAX_FAILED = 1024  # failure records kept (each only in memory); the oldest go first


class FetchBackoff(SourceError):
    """A fetch failed (`reason` is that failure's); the next try is allowed in `retry_after_s` seconds."""

    def __init__(self, reason: str, message: str, retry_after_s: float) -> None:
        super().__init__(reason, message)
        self.retry_after_s = retry_after_s


@dataclass
class _Entry:
    sha256: str
    source: str
    state: str  # "downloading" | "disk" | "failed"
    size: int | None = None  # bytes of the two files, once on disk
    last_used: float | None = None  # time.time()
    downloads: int = 0  # completed downloads
    download_s: float | None = None  # how long the last download took (None: on disk since this process started)
    error: SourceError | None = None  # the last failure
    failures: int = 0  # failures in a row
    retry_at: float = 0.0  # time.monotonic() before which a failed fetch is not tried again
    future: Future[Path] | None = None  # the download in progress
    adapter: dict[str, Any] | None = None  # what it is (loragate_common/adapter_kinds.py), once on disk


class AdapterCache:
    """Fetched adapters on local disk by sha256: `ensure` fetches (once), `entry` finds, `pin` protects."""

    def __init__(
        self,
        root: Path,
        max_bytes: int,
        max_adapter_bytes: int,
        allow: AllowList,
        fetch_timeout_s: float,
        on_evict: Callable[[str], None],
        *,
        backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        max_downloads: int = 4,
    ) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.max_adapter_bytes = max_adapter_bytes
        self.fetch_timeout_s = fetch_timeout_s
        self._allow = allow
        self._on_evict = on_evict
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._pins: dict[str, int] = {}
        self._download_slots = threading.BoundedSemaphore(max_downloads)
        # For the metrics (engine/entrypoints/metrics.py, vllm_agent/metrics.py): downloads that succeeded and
        # failed, entries evicted.
        self.downloads = self.failures = self.evictions = 0
        self.root.mkdir(parents=True, exist_ok=True)
        self._load()

    def _load(self) -> None:
        """Remove what a killed download left; keep complete entries, least recently used first."""
        found: list[tuple[float, _Entry]] = []
        for child in self.root.iterdir():
            if child.name.startswith(TMP_PREFIX):
                logger.info("removing %s, left by an interrupted download", child)
                shutil.rmtree(child, ignore_errors=True)
            elif _HEX64.fullmatch(child.name) and child.is_dir():
                entry = _read_entry(child)
                if entry is None:
                    logger.warning("removing %s: not a complete cache entry", child)
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    found.append((child.stat().st_mtime, entry))
        for mtime, entry in sorted(found, key=lambda item: item[0]):
            entry.last_used = mtime
            self._entries[entry.sha256] = entry
        with self._lock:
            evicted = self._evict_locked(0)
        self._removed(evicted)

    def entry(self, sha256: str) -> Path | None:
        """The complete cached directory for `sha256`, marked as used; None if there is none."""
        with self._lock:
            return self._disk_path_locked(sha256)

    async def ensure(self, source: str, sha256: str, size: int | None) -> Path:
        """The cached directory for `sha256`, fetched from `source` first if needed (one download however many
        callers wait). SourceError when `source` is invalid or not allowed; FetchBackoff when the fetch
        failed, now or within the backoff of an earlier failure."""
        if _HEX64.fullmatch(sha256) is None:
            raise SourceError("invalid", "sha256 must be 64 lowercase hex digits")
        parsed = parse_source(source)
        self._allow.check(parsed)
        with self._lock:
            path = self._disk_path_locked(sha256)
            if path is not None:
                return path
            future = self._start_locked(parsed, sha256, size)
        # shield: a caller that stops waiting does not cancel the download the others share.
        return await asyncio.shield(asyncio.wrap_future(future))

    def pin(self, sha256: str) -> None:
        """Mark `sha256` in use (counted): never evicted until unpinned as often. May precede its entry."""
        with self._lock:
            self._pins[sha256] = self._pins.get(sha256, 0) + 1

    def unpin(self, sha256: str) -> None:
        with self._lock:
            count = self._pins.get(sha256, 0)
            if count == 0:
                raise ValueError(f"sha256 {sha256[:12]} is not pinned")
            if count == 1:
                del self._pins[sha256]
            else:
                self._pins[sha256] = count - 1

    def status(self) -> list[dict[str, Any]]:
        """Every entry (least recently used first): downloading, on disk, or failed (with its error)."""
        now = time.monotonic()
        with self._lock:
            return [self._status_locked(e, now) for e in self._entries.values()]

    def status_of(self, sha256: str) -> dict[str, Any] | None:
        """One entry as status() shows it; None when the cache has no entry for `sha256`."""
        with self._lock:
            entry = self._entries.get(sha256)
            return self._status_locked(entry, time.monotonic()) if entry is not None else None

    def _status_locked(self, e: _Entry, now: float) -> dict[str, Any]:
        failed = e.error is not None and e.state == "failed"
        return {
            "sha256": e.sha256,
            "source": e.source,
            "state": e.state,
            "error": str(e.error) if failed else None,
            "reason": e.error.reason if failed and e.error is not None else None,
            "retry_after_s": max(0.0, e.retry_at - now) if e.state == "failed" else None,
            "size": e.size,
            "last_used": e.last_used,
            "downloads": e.downloads,
            "download_s": e.download_s,
            "pins": self._pins.get(e.sha256, 0),
            "adapter": e.adapter,
        }

    def total_bytes(self) -> int:
        with self._lock:
            return self._total_locked()

    def _disk_path_locked(self, sha256: str) -> Path | None:
        entry = self._entries.get(sha256)
        if entry is None or entry.state != "disk":
            return None
        path = self.root / sha256
        if not path.is_dir():  # removed behind our back: fetch it again
            del self._entries[sha256]
            return None
        entry.last_used = time.time()
        self._entries.move_to_end(sha256)
        with contextlib.suppress(OSError):
            os.utime(path)  # the next start orders entries by this
        return path

    def _start_locked(self, source: Source, sha256: str, size: int | None) -> Future[Path]:
        entry = self._entries.get(sha256)
        if entry is not None and entry.future is not None:
            return entry.future
        if entry is not None and entry.state == "failed":
            left = entry.retry_at - time.monotonic()
            if left > 0:
                assert entry.error is not None
                message = f"{entry.error} (not tried again for {left:.1f} s)"
                raise FetchBackoff(entry.error.reason, message, left)
        if entry is None:
            entry = self._entries[sha256] = _Entry(sha256, str(source), "downloading")
        entry.source, entry.state = str(source), "downloading"
        future: Future[Path] = Future()
        entry.future = future
        # A daemon thread: an engine that exits mid-download is not held up; the next start removes the temp dir.
        args = (future, source, sha256, size)
        threading.Thread(target=self._run, args=args, name=f"adapter-fetch-{sha256[:8]}", daemon=True).start()
        return future

    def _run(self, future: Future[Path], source: Source, sha256: str, size: int | None) -> None:
        with self._download_slots:  # at most `max_downloads` at once; the deadline starts in the slot
            try:
                future.set_result(self._download(source, sha256, size))
            except BaseException as exc:
                future.set_exception(exc)

    def _download(self, source: Source, sha256: str, size: int | None) -> Path:
        """In a worker thread: fetch into a temp dir, make room, publish by rename."""
        tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=self.root))
        evicted: list[str] = []
        started = time.monotonic()
        try:
            fetched = fetch(
                source, tmp, sha256=sha256, size=size, max_bytes=self.max_adapter_bytes, deadline_s=self.fetch_timeout_s
            )
            adapter = _write_meta(tmp, source, sha256, fetched)
            with self._lock:
                evicted = self._evict_locked(fetched.size)
                os.rename(tmp, self.root / sha256)
                entry = self._entries[sha256]
                entry.state, entry.size, entry.future = "disk", fetched.size, None
                entry.last_used, entry.error, entry.failures = time.time(), None, 0
                entry.adapter = adapter
                entry.downloads += 1
                entry.download_s = time.monotonic() - started
                self.downloads += 1
                self._entries.move_to_end(sha256)
            _fsync(self.root)
        except Exception as exc:
            error = exc if isinstance(exc, SourceError) else SourceError("unreachable", f"storing it failed: {exc}")
            if not isinstance(exc, SourceError):
                logger.exception("adapter %s from %s: storing it failed", sha256[:12], source)
            raise self._failed(sha256, error) from exc
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            self._removed(evicted)
        logger.info("adapter %s fetched from %s (%d bytes)", sha256[:12], source, fetched.size)
        return self.root / sha256

    def _failed(self, sha256: str, error: SourceError) -> FetchBackoff:
        with self._lock:
            self.failures += 1
            entry = self._entries[sha256]
            entry.failures += 1
            delay = min(self._max_backoff_s, self._backoff_s * 2 ** (entry.failures - 1))
            entry.state, entry.error, entry.future = "failed", error, None
            entry.retry_at = time.monotonic() + delay
            failed = [e for e in self._entries.values() if e.state == "failed"]
            for old in sorted(failed, key=lambda e: e.retry_at)[: max(0, len(failed) - _MAX_FAILED)]:
                del self._entries[old.sha256]
        logger.warning("adapter %s: %s (next try in %g s)", sha256[:12], error, delay)
        return FetchBackoff(error.reason, f"{error} (not tried again for {delay:g} s)", delay)

    def _total_locked(self) -> int:
        return sum(e.size or 0 for e in self._entries.values() if e.state == "disk")

    def _evict_locked(self, incoming: int) -> list[str]:
        """Make room for `incoming` bytes: least recently used unpinned entries go, renamed out of the way
        here (their files are deleted after the lock is released). SourceError("too_large") if pinned
        entries leave too little room; then nothing is evicted."""
        excess = self._total_locked() + incoming - self.max_bytes
        victims: list[_Entry] = []
        for entry in self._entries.values():
            if excess <= 0:
                break
            if entry.state == "disk" and self._pins.get(entry.sha256, 0) == 0:
                victims.append(entry)
                excess -= entry.size or 0
        if excess > 0:
            raise SourceError(
                "too_large",
                f"{incoming} bytes do not fit the adapter cache ({self.max_bytes} bytes): it is full of adapters "
                "in use",
            )
        self.evictions += len(victims)
        for entry in victims:
            os.rename(self.root / entry.sha256, self.root / f"{TMP_PREFIX}evicted-{entry.sha256}")
            del self._entries[entry.sha256]
        return [entry.sha256 for entry in victims]

    def _removed(self, evicted: list[str]) -> None:
        """Delete evicted entries' files and tell the engine (outside the lock: it may call back in)."""
        for sha256 in evicted:
            shutil.rmtree(self.root / f"{TMP_PREFIX}evicted-{sha256}", ignore_errors=True)
            logger.info("adapter %s evicted from the disk cache", sha256[:12])
            try:
                self._on_evict(sha256)
            except Exception:
                logger.exception("on_evict(%s) failed", sha256[:12])


def _write_meta(directory: Path, source: Source, sha256: str, fetched: Fetched) -> dict[str, Any] | None:
    """Write and fsync meta.json beside the fetched files; returns what the adapter is (`summarize_dir`)."""
    adapter = summarize_dir(directory)
    meta = {
        "source": str(source),
        "sha256": sha256,
        "size": fetched.size,
        "fetched_at": time.time(),
        "content_sha256": fetched.digest,
        "archive_sha256": fetched.archive_digest,
        "revision": fetched.revision,
        "adapter": adapter,
    }
    (directory / META).write_text(json.dumps(meta, indent=1) + "\n")
    for name in (*ADAPTER_FILES, META):
        with open(directory / name, "rb") as f:
            os.fsync(f.fileno())
    _fsync(directory)
    return adapter


def _fsync(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_entry(directory: Path) -> _Entry | None:
    """The entry a complete cache directory holds, or None (its meta or files missing or inconsistent)."""
    try:
        meta = json.loads((directory / META).read_text())
        size = sum((directory / name).stat().st_size for name in ADAPTER_FILES)
        if not isinstance(meta, dict) or meta.get("sha256") != directory.name or meta.get("size") != size:
            return None
        adapter = meta.get("adapter")
        entry = _Entry(directory.name, str(meta.get("source", "")), "disk", size)
        entry.adapter = adapter if isinstance(adapter, dict) else summarize_dir(directory)
        return entry
    except (OSError, ValueError):
        return None


class AdapterCacheCollector:
    """A disk cache's Prometheus series, read at scrape time, named `<prefix>_cache_bytes`, `_cache_limit_bytes`,
    `_cache_entries{state}`, `_downloads_total`, `_download_failures_total`, `_cache_evictions_total` (the engine's
    prefix is `loragate_engine_adapter`, the vLLM agent's `loragate_vllm_agent`). No per-adapter label (GET
    /v1/adapters lists each one), so the series stay few however many adapters are fetched. `cache` is set once
    there is one (an engine without --adapter-cache-dir has none)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.cache: AdapterCache | None = None

    def collect(self) -> Iterator[Metric]:
        cache, p = self.cache, self.prefix
        if cache is None:
            return
        entries = cache.status()
        yield GaugeMetricFamily(f"{p}_cache_bytes", "Bytes of fetched adapters on disk.", value=cache.total_bytes())
        yield GaugeMetricFamily(
            f"{p}_cache_limit_bytes", "The disk cache's bound (--adapter-cache-mb).", value=cache.max_bytes
        )
        states = GaugeMetricFamily(f"{p}_cache_entries", "Fetched adapters by state.", labels=["state"])
        for state in ("downloading", "disk", "failed"):
            states.add_metric([state], sum(1 for e in entries if e["state"] == state))
        yield states
        for name, doc, value in (
            ("downloads", "Adapter downloads that completed (verified and stored).", cache.downloads),
            ("download_failures", "Adapter downloads that failed.", cache.failures),
            ("cache_evictions", "Fetched adapters evicted from the disk cache.", cache.evictions),
        ):
            yield CounterMetricFamily(f"{p}_{name}", doc, value=value)
