"""Registered adapters by id, and their weights in a byte-bounded LRU in host RAM.

Registering validates an adapter directory from its config and safetensors header only
(engine/lora/files.py), so a registered adapter costs a few KB; weights are read on first use into
`HostAdapterCache`. The device tier above this one is engine/lora/device_tier.py.

A weighted mix a request names resolves here too (`AdapterRegistry.mix`): each part to its registered version, the
whole to a derived spec kept in a bounded LRU (engine/lora/mixes.py), whose weights the host tier builds from its
parts' rather than reading files.
"""

from __future__ import annotations

import builtins
import dataclasses
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from engine.lora.files import LoraWeights, load_weights, read_adapter, resolve_inside
from engine.lora.mixes import DerivedMixes, PartUnusable, mix_weights, parse
from engine.lora.peft_config import AdapterError, AdapterKey, AdapterSpec, validate_adapter_id
from engine.lora.vocab_lora import BaseVocab
from engine.model.config import ModelConfig

logger = logging.getLogger(__name__)


class AdapterRegistry:
    """Registered adapters by id; thread-safe (the HTTP thread registers while the engine thread reads)."""

    def __init__(self, model: ModelConfig, base: BaseVocab | None = None) -> None:
        """`base`: the served model's digests of its embedding and LM head, which copies of them saved beside an
        adapter are compared with (engine/lora/vocab_lora.py); without it such an adapter is refused."""
        self._model = model
        self._base = base
        self._lock = threading.Lock()
        self._specs: dict[str, AdapterSpec] = {}
        # Survives unregister(): a re-registered id never reuses a version, so caches keyed by
        # (id, version) never serve an older content.
        self._versions: dict[str, int] = {}
        # (id, version) -> why its weights could not be loaded. A version's content never changes, so
        # its later requests fail at once; registering the id again makes a new version.
        self._broken: dict[AdapterKey, str] = {}
        self._mixes = DerivedMixes()  # derived specs of mixes, by their parts' versions

    def register(self, adapter_id: str, path: Path, verify: Callable[[AdapterSpec], None] | None = None) -> AdapterSpec:
        """Validate and (re-)register an adapter; the first registration of an id is version 1.

        `verify(spec)` may read and check the weights too (AdapterError refuses the adapter); without it
        only the config and the safetensors header are read.
        """
        validate_adapter_id(adapter_id)
        spec = read_adapter(path, adapter_id, 0, self._model, self._base)  # file reads happen outside the lock
        if verify is not None:
            verify(spec)
        with self._lock:
            version = self._versions.get(adapter_id, 0) + 1
            self._versions[adapter_id] = version
            spec = dataclasses.replace(spec, version=version)
            self._specs[adapter_id] = spec
        logger.info(
            "registered adapter %s v%d from %s (modules %s, max rank %d, %.1f MB fp32)",
            adapter_id,
            version,
            spec.path,
            ",".join(spec.modules),
            spec.max_rank,
            spec.nbytes / 2**20,
        )
        return spec

    def unregister(self, adapter_id: str) -> AdapterSpec:
        """Remove an adapter; KeyError if it is not registered."""
        with self._lock:
            spec = self._specs.pop(adapter_id)
        logger.info("unregistered adapter %s v%d", adapter_id, spec.version)
        return spec

    def mark_broken(self, spec: AdapterSpec, reason: str) -> None:
        with self._lock:
            self._broken[spec.key] = reason
        logger.warning("adapter %s v%d is unusable until registered again: %s", spec.adapter_id, spec.version, reason)

    def broken(self, spec: AdapterSpec) -> str | None:
        """Why this version's weights could not be loaded, or None."""
        with self._lock:
            return self._broken.get(spec.key)

    def get(self, adapter_id: str) -> AdapterSpec:
        """The current spec of an adapter; KeyError if it is not registered."""
        with self._lock:
            return self._specs[adapter_id]

    def mix(self, name: str) -> AdapterSpec:
        """The derived adapter of the mix `name` writes (`a*0.7+b*0.3`, parts in any order) over its parts' current
        versions: one object per set of part versions while kept. KeyError(ref) for a part that is not registered,
        AdapterError for a malformed name or a part that cannot be mixed (engine/lora/mixes.py)."""
        parts = parse(name)
        with self._lock:
            return self._mixes.get([(self._specs[part.ref], part.weight) for part in parts])

    def derived(self, mix_id: str) -> AdapterSpec | None:
        """The newest derived spec kept for a mix's canonical name, None if none is."""
        with self._lock:
            return self._mixes.newest(mix_id)

    def retire_mixes(self, adapter_id: str) -> dict[str, int | None]:
        """After `adapter_id` was registered again or unregistered: forget the mixes built from an older version
        of it; {mix id: the version to keep, or None} of every kept mix it is a part of (DerivedMixes.retire)."""
        with self._lock:
            return self._mixes.retire(adapter_id, lambda part: self._specs.get(part.adapter_id) is part)

    def list(self) -> list[AdapterSpec]:
        with self._lock:
            return sorted(self._specs.values(), key=lambda spec: spec.adapter_id)

    def scan_dir(self, adapter_dir: Path) -> builtins.list[AdapterSpec]:  # (`list` here: the method above)
        """Register every subdirectory of `adapter_dir` under its folder name; log and skip broken ones."""
        root = Path(adapter_dir)
        if not root.is_dir():
            raise AdapterError(f"adapter directory {str(root)!r} does not exist or is not a directory")
        specs = []
        for sub in sorted(root.iterdir()):
            if not sub.is_dir():
                continue
            try:
                path = resolve_inside(root, sub.name)  # a symlink out of the directory is refused
                specs.append(self.register(validate_adapter_id(sub.name), path))
            except AdapterError as exc:
                logger.warning("skipping %s: %s", sub, exc)
        return specs


class HostAdapterCache:
    """Parsed adapter weights in host RAM, keyed by (id, version), least recently used evicted first.

    `capacity_bytes` bounds the sum of cached LoraWeights.nbytes. Loads happen outside the lock, so two
    threads missing the same adapter at once may both read it; only one copy is kept.
    """

    def __init__(self, capacity_bytes: int, model: ModelConfig, dtype: torch.dtype) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._model = model
        self._dtype = dtype
        self._lock = threading.Lock()
        self._entries: OrderedDict[AdapterKey, LoraWeights] = OrderedDict()  # oldest use first
        self._used = 0
        self.hits = self.misses = self.loads = self.evictions = 0

    @property
    def used_bytes(self) -> int:
        return self._used

    def get(self, spec: AdapterSpec) -> LoraWeights:
        """The adapter's weights: cached, or loaded (AdapterError if the file is now unusable)."""
        key = spec.key
        with self._lock:
            weights = self._entries.get(key)
            if weights is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return weights
            self.misses += 1
        return self._load(spec)

    def prefetch(self, spec: AdapterSpec) -> None:
        """Load an adapter into the cache unless it is there (not counted as a hit or a miss)."""
        if not self.contains(spec):
            self._load(spec)

    def preload(self, specs: Iterable[AdapterSpec]) -> int:
        """Read adapters into the cache, in order, each that fits beside what it holds (nothing is evicted: S-LoRA
        keeps its adapters in host memory); returns how many it read. An unusable one is skipped: its requests get
        the error when they come."""
        loaded = 0
        for spec in specs:
            if self.contains(spec) or self._used + spec.nbytes * self._dtype.itemsize // 4 > self.capacity_bytes:
                continue  # (spec.nbytes counts fp32)
            try:
                self._load(spec)
            except AdapterError as exc:
                logger.warning("not preloading adapter %s: %s", spec.adapter_id, exc)
                continue
            loaded += 1
        return loaded

    def contains(self, spec: AdapterSpec) -> bool:
        with self._lock:
            return spec.key in self._entries

    def discard(self, adapter_id: str, keep_version: int | None = None) -> None:
        """Drop every cached version of an adapter but `keep_version`."""
        with self._lock:
            for key in [key for key in self._entries if key[0] == adapter_id and key[1] != keep_version]:
                self._used -= self._entries.pop(key).nbytes

    def _part(self, mix: AdapterSpec, part: AdapterSpec) -> LoraWeights:
        try:
            return self.get(part)
        except AdapterError as exc:
            raise PartUnusable(part, f"adapter mix {mix.adapter_id!r}: {exc}") from None

    def _load(self, spec: AdapterSpec) -> LoraWeights:
        if spec.parts:  # a mix: built from its parts' weights, each cached (or read) here as an adapter of its own
            weights = mix_weights(spec, [self._part(spec, part) for part, _ in spec.parts])
        else:
            weights = load_weights(spec, self._model, self._dtype)
        key = spec.key
        with self._lock:
            self.loads += 1
            if key in self._entries:  # another thread loaded it meanwhile
                self._entries.move_to_end(key)
                return self._entries[key]
            if weights.nbytes > self.capacity_bytes:
                logger.warning(
                    "adapter %s (%d bytes) is larger than the host adapter cache (%d bytes); not caching it",
                    spec.adapter_id,
                    weights.nbytes,
                    self.capacity_bytes,
                )
                return weights
            while self._used + weights.nbytes > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._used -= evicted.nbytes
                self.evictions += 1
            self._entries[key] = weights
            self._used += weights.nbytes
        return weights
