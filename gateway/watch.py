"""Notice when the policy file changes, so the gateway can reload it without a restart or an admin call.

Polling, not inotify: it works the same on every filesystem (overlayfs, NFS, a Kubernetes volume) and
needs no dependency, and once a second is plenty for a file people edit by hand or deploy. A policy file
changes in three ways, and all three are seen:

- an edit in place: same inode, new size or modification time;
- an atomic replace (write a temporary file, rename it over the old one): a new inode;
- a Kubernetes ConfigMap update: the mounted `policy.yaml` is a symlink to `..data/policy.yaml`, and
  `..data` a symlink to a timestamped directory; the kubelet writes a new directory and renames a new
  `..data` over the old one. `os.stat` follows the links (a new inode) and the resolved path changes.

Each poll costs one `stat`. Only when the stat signature differs is the file read and hashed, and only a
new content hash fires the callback, so a `touch` or a ConfigMap update that rewrites the same text does
not reload. A stat signature alone can miss a rewrite of the same size within one tick of the
filesystem's clock, so while the file's modification time is that close to the last read (git's "racily
clean" case) it is hashed on every poll until it is old enough for its stat to be trusted.

A file that vanishes or cannot be read is reported once and otherwise ignored: the gateway keeps its
policy, and the callback fires only when the file is back with content different from the last seen.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PolicyWatcher"]

logger = logging.getLogger(__name__)

# Modification times within this of the last read may hide a same-size rewrite (coarse mtime clocks:
# a kernel tick on Linux, 2 s on FAT), so such a file is hashed again on every poll.
_RACY_WINDOW_NS = 2_000_000_000


@dataclass(frozen=True, slots=True)
class _Signature:
    """What one stat says about the file; any difference means "read it again"."""

    realpath: str
    dev: int
    ino: int
    size: int
    mtime_ns: int


class PolicyWatcher:
    """Poll a file and call `on_change()` when its content changes (never for the content it starts with)."""

    def __init__(self, path: Path, on_change: Callable[[], None] | None = None, interval_s: float = 1.0) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be more than 0, got {interval_s!r}")
        self.path = Path(path)
        self.interval_s = interval_s
        self._on_change = on_change
        self._signature: _Signature | None = None  # None: not read since it was last missing
        self.digest: str | None = None  # sha256 of the last content read; kept while the file is missing
        self._read_at_ns = 0  # wall clock (the filesystem's timescale) of the last read
        self._missing = False
        self._poll(initial=True)

    def check(self) -> bool:
        """One poll: call on_change() and return True if the content changed since the last poll.

        The new content is recorded before on_change() runs, so a callback that raises is not retried for
        the same content; the exception propagates to the caller.
        """
        if not self._poll(initial=False):
            return False
        if self._on_change is not None:
            self._on_change()
        return True

    async def run(self) -> None:
        """Poll every interval_s until cancelled; an exception in on_change is logged and polling goes on.

        Polls run on the event loop (a stat, and a read of a small file when it changed), so on_change
        may touch the gateway's state without locks.
        """
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.check()
            except Exception:
                logger.exception("policy watcher: handling a change of %s failed", self.path)

    def _poll(self, initial: bool) -> bool:
        """Update the recorded state; True if the content differs from the last content seen."""
        signature = self._stat()
        if signature is not None and signature == self._signature and not self._racy(signature):
            return False
        content = self._read() if signature is not None else None
        if signature is None or content is None:
            self._signature = None
            return False
        if self._missing:
            logger.info("policy file %s is readable again", self.path)
            self._missing = False
        self._signature = signature
        self._read_at_ns = time.time_ns()
        digest = hashlib.sha256(content).hexdigest()
        changed = not initial and digest != self.digest
        self.digest = digest
        if changed:
            logger.info("policy file %s changed (sha256 %s)", self.path, digest[:12])
        return changed

    def _racy(self, signature: _Signature) -> bool:
        return signature.mtime_ns >= self._read_at_ns - _RACY_WINDOW_NS

    def _stat(self) -> _Signature | None:
        try:
            st = os.stat(self.path)  # follows symlinks: a ConfigMap swap shows as a new inode
            realpath = os.path.realpath(self.path)
        except OSError as exc:
            self._note_missing(exc)
            return None
        return _Signature(realpath, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def _read(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except OSError as exc:
            self._note_missing(exc)
            return None

    def _note_missing(self, exc: OSError) -> None:
        if not self._missing:
            logger.warning(
                "policy file %s is missing or unreadable (%s); keeping the current policy until it is back",
                self.path,
                exc.strerror or exc,
            )
            self._missing = True
