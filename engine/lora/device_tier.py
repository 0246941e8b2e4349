"""The device tier of adapters: LoRA weights resident in the unified page pool, LRU, pinned while used.

An adapter on the device owns one run of consecutive pages. In every layer that run is one contiguous
region of `kv_cache[layer]` holding, module group by module group (q/k/v, o, gate/up, down: the model's
fused projections), the A ([r, in]) of every targeted module of the group stacked in module order, then
their scale-folded B transposed ([r, out]), and for a DoRA adapter the group's row scales (computed here, once, from
the base's projections: engine/lora/dora.py), row-major at element offsets recorded in slot tables
(engine/lora/tables.py SlotTables). The batched-LoRA kernels read the weights straight from the pool through those
tables, never copying them; one shrink serves a whole group. For the Triton kernels and the CPU's C++ op the tier
also keeps a mirror of the tables (`DeviceMirror`), updated when an adapter is loaded or evicted, never rebuilt
per step.
Pages taken are proportional to the adapter's own ranks, never padded to a maximum rank.

Residency changes only between engine steps, in the engine thread. An adapter is pinned while a running
request uses it and is evicted (least recently used first) only when unpinned.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from engine.core.memory import PagePool
from engine.lora.dora import DoraNorms
from engine.lora.files import LoraWeights
from engine.lora.peft_config import GROUPS, AdapterError, AdapterKey, AdapterSpec, LoraTarget, module_features
from engine.lora.registry import HostAdapterCache
from engine.lora.tables import DeviceMirror, PoolWeights, SlotTables, group_in_features, group_out_cols
from engine.lora.vocab_lora import VocabSlots
from engine.model.config import ModelConfig

logger = logging.getLogger(__name__)

LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)


@dataclass(slots=True)
class Resident:
    spec: AdapterSpec
    slot: int
    first_page: int
    num_pages: int
    pins: int = 0
    stale: bool = False  # a newer version was loaded or the adapter was unloaded


@dataclass(slots=True)
class TierCounters:
    hits: int = 0
    misses: int = 0
    loads: int = 0
    evictions: int = 0
    load_seconds_sum: float = 0.0
    load_buckets: list[int] = field(default_factory=lambda: [0] * len(LOAD_BUCKETS))
    # Device loads and evictions per adapter id (every version), for the per-adapter metrics. They change with
    # `loads` and `evictions` under `lock`: the metrics (another thread) fold the ids without a label of their
    # own into total minus labelled, which must come from one moment or that counter would seem to go back.
    loads_by_adapter: dict[str, int] = field(default_factory=dict)
    evictions_by_adapter: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count_load(self, adapter_id: str) -> None:
        with self.lock:
            self.loads += 1
            self.loads_by_adapter[adapter_id] = self.loads_by_adapter.get(adapter_id, 0) + 1

    def count_eviction(self, adapter_id: str) -> None:
        with self.lock:
            self.evictions += 1
            self.evictions_by_adapter[adapter_id] = self.evictions_by_adapter.get(adapter_id, 0) + 1

    def by_adapter(self, adapter_ids: Iterable[str]) -> tuple[dict[str, tuple[int, int]], int, int]:
        """({id: (loads, evictions)} for `adapter_ids`, all loads, all evictions), read at one moment (safe
        from any thread; O(len(adapter_ids)), however many adapters were ever loaded)."""
        with self.lock:
            counts = {a: (self.loads_by_adapter.get(a, 0), self.evictions_by_adapter.get(a, 0)) for a in adapter_ids}
            return counts, self.loads, self.evictions


class DeviceAdapterTier:
    def __init__(
        self,
        pool: PagePool,
        kv_cache: torch.Tensor,
        model: ModelConfig,
        max_adapters: int,
        host: HostAdapterCache,
        reclaim: Callable[[], bool] | None = None,
        mirror: bool = False,
        base: DoraNorms | None = None,
    ) -> None:
        """`mirror`: keep a tensor copy of the slot tables on the pool's device (the C++ and Triton LoRA routes read
        it: engine/lora/routes.py `LoraRoute.mirror`). `base`: the base model's side of DoRA (its projections, for the
        row scales); without it a DoRA adapter cannot be brought onto the device."""
        self.pool = pool
        # Frees one idle page held elsewhere (a cached KV block); False when there is none. Tried before
        # evicting idle adapters when no run of free pages is long enough.
        self.reclaim = reclaim
        self.model = model
        self.host = host
        self.max_adapters = max_adapters
        # One flat view per layer: [num_pages * page_elems]; page p starts at p * page_elems.
        self.layer_pools = [kv_cache[layer].view(-1) for layer in range(kv_cache.shape[0])]
        self.cache_rows = kv_cache.view(kv_cache.shape[0], -1)  # [layers, num_pages * page_elems]: runs of all layers
        self.stage_copies = kv_cache.is_cuda  # loads copy through one host table (`_copy_run`)
        self.page_elems = kv_cache[0, 0].numel()
        self.dtype = kv_cache.dtype
        self.null_slot = max_adapters  # never holds an adapter: rows without one use it
        self.tables = SlotTables.empty(model.num_layers, max_adapters + 1)
        out_cols = group_out_cols(model)
        self.mirror = DeviceMirror(model.num_layers, max_adapters + 1, out_cols, kv_cache.device) if mirror else None
        # what a LoraBatch reads
        self.weights = PoolWeights(self.layer_pools, self.tables, out_cols, group_in_features(model), self.mirror)
        self.resident: OrderedDict[AdapterKey, Resident] = OrderedDict()  # LRU first
        self._free_slots = list(range(max_adapters - 1, -1, -1))
        self.counters = TierCounters()
        # each slot's LoRA on the embedding and the LM head, beside the pool (engine/lora/vocab_lora.py)
        self.vocab = VocabSlots(max_adapters + 1, kv_cache.device, kv_cache.dtype)
        self.base = base

    # ---- sizing ---------------------------------------------------------------------------------------

    def pages_needed(self, spec: AdapterSpec) -> int:
        """Pages for this adapter: its largest layer's A and B elements (and DoRA scales), rounded up to whole pages."""
        per_layer = max((self._layer_elements(spec, layer) for layer in spec.layers), default=0)
        return max(1, -(-per_layer // self.page_elems))

    def _layer_elements(self, spec: AdapterSpec, layer: dict[str, LoraTarget]) -> int:
        elements = sum(t.rank * sum(module_features(self.model, m)) for m, t in layer.items())
        if spec.dora:  # a scale per output column of every group the layer adapts
            cols = self.weights.out_cols
            elements += sum(cols[group][-1] for group, names in GROUPS.items() if any(m in layer for m in names))
        return elements

    # ---- residency ------------------------------------------------------------------------------------

    def slot_of(self, spec: AdapterSpec) -> int | None:
        res = self.resident.get(spec.key)
        return None if res is None else res.slot

    def is_resident(self, spec: AdapterSpec) -> bool:
        return spec.key in self.resident

    def current_ids(self) -> tuple[str, ...]:
        """The ids resident on the device, sorted; a version kept only for the requests still running on it
        (stale) is not counted: new requests cannot use it."""
        return tuple(sorted({key.adapter_id for key, res in self.resident.items() if not res.stale}))

    def ensure_resident(self, spec: AdapterSpec) -> bool:
        """Bring `spec` onto the device, evicting idle adapters as needed; False if it cannot be now."""
        key = spec.key
        if key in self.resident:
            self.resident.move_to_end(key)
            self.counters.hits += 1
            return True
        self.counters.misses += 1
        while len(self.resident) >= self.max_adapters:
            if not self.evict_idle():
                return False
        n = self.pages_needed(spec)
        start = self.pool.allocate_run(n, f"adapter:{spec.adapter_id}@{spec.version}")
        while start is None:
            reclaimed = self.reclaim is not None and self.reclaim()
            if not reclaimed and not self.evict_idle():
                return False
            start = self.pool.allocate_run(n, f"adapter:{spec.adapter_id}@{spec.version}")
        t0 = time.perf_counter()
        slot = self._free_slots.pop()
        try:
            self._write(spec, slot, start, n)
        except Exception:  # e.g. the adapter's file is now unusable: nothing of it stays behind
            self._clear_slot(slot)
            self._free_slots.append(slot)
            self.pool.free_run(start, n)
            raise
        self._observe_load(time.perf_counter() - t0)
        return True

    def _write(self, spec: AdapterSpec, slot: int, start: int, n: int) -> None:
        self.weights.generation += 1
        weights = self.host.get(spec)  # host tier: hit, or read from disk
        base = start * self.page_elems
        pieces: list[list[torch.Tensor]] = []  # per layer, the run's contents in order
        for layer, modules in enumerate(weights.layers):
            offset, layer_pieces = base, []
            for group, names in GROUPS.items():
                targeted = [m for m in names if m in modules]
                self.tables.a_offsets[layer][group][slot] = offset
                for module in targeted:  # the group's A [r, in] stacked: one shrink serves them all
                    a = modules[module][0]
                    layer_pieces.append(a.reshape(-1))
                    offset += a.numel()
                for module in names:
                    if module not in modules:
                        self.tables.ranks[layer][module][slot] = 0
                        continue
                    a, b = modules[module]  # b: [out, r] with the scale folded in, stored transposed
                    self.tables.b_offsets[layer][module][slot] = offset
                    layer_pieces.append(b.t().reshape(-1))  # a view: the host tier holds B.T contiguous
                    offset += b.numel()
                    self.tables.ranks[layer][module][slot] = a.shape[0]
                total = sum(self.tables.ranks[layer][m][slot] for m in names)
                self.weights.max_rank[group] = max(self.weights.max_rank[group], total)
                self.tables.g_offsets[layer][group][slot] = offset if spec.dora and targeted else -1
                if spec.dora and targeted:  # the group's row scales, after its B
                    layer_pieces.append(self._dora_scales(weights, layer, group))
                    offset += self.weights.out_cols[group][-1]
            assert offset <= base + n * self.page_elems
            pieces.append(layer_pieces)
        self._copy_run(base, pieces)
        self.vocab.write(slot, weights.vocab)
        if spec.dora:
            self.tables.dora_slots.add(slot)
        if self.mirror is not None:
            self.mirror.update(self.tables, slot)
        self.resident[spec.key] = Resident(spec, slot, start, n)
        self.counters.count_load(spec.adapter_id)

    def _dora_scales(self, weights: LoraWeights, layer: int, group: str) -> torch.Tensor:
        """A DoRA adapter's row scales for `group` in `layer`, in the pool's dtype (engine/lora/dora.py)."""
        spec = weights.spec
        if self.base is None:
            raise AdapterError(
                f"adapter {spec.adapter_id!r} is a DoRA adapter, and this device tier has no base model to compute "
                "its scales from"
            )
        modules = {
            module: (*weights.layers[layer][module], weights.magnitudes[layer][module])
            for module in GROUPS[group]
            if module in weights.layers[layer]
        }
        return self.base.scales(spec, layer, group, modules).to(self.dtype)

    def _copy_run(self, base: int, pieces: list[list[torch.Tensor]]) -> None:
        """Write each layer's pieces, in order, from element `base` of that layer's pool.

        On the CPU each layer's pieces are concatenated straight into its pool. On a GPU they are concatenated
        into one pinned host table [layers, width] and copied with one non-blocking copy into the run's
        region of every layer (a strided view of the cache), instead of one blocking copy per matrix (7 modules
        x 2 x 32 layers = 448 for a Llama-8B adapter); the engine's stream orders the step that reads them after it.
        """
        lengths = [sum(p.numel() for p in layer) for layer in pieces]
        width = max(lengths, default=0)
        if width == 0:
            return
        staged = None
        if self.stage_copies:
            staged = torch.zeros(len(pieces), width, dtype=self.dtype, pin_memory=self.cache_rows.is_cuda)
        for i, (layer, n) in enumerate(zip(pieces, lengths, strict=True)):
            if n:
                torch.cat(layer, out=self.layer_pools[i][base : base + n] if staged is None else staged[i, :n])
        if staged is not None:
            self.cache_rows[: len(pieces), base : base + width].copy_(staged, non_blocking=True)

    def _observe_load(self, seconds: float) -> None:
        self.counters.load_seconds_sum += seconds
        for i, bound in enumerate(LOAD_BUCKETS):
            if seconds <= bound:
                self.counters.load_buckets[i] += 1

    def evict_idle(self) -> bool:
        """Evict the least recently used unpinned adapter (stale ones first); False if none is idle."""
        idle = [key for key, res in self.resident.items() if res.pins == 0]
        if not idle:
            return False
        stale = [key for key in idle if self.resident[key].stale]
        self._evict((stale or idle)[0])
        return True

    def _evict(self, key: AdapterKey) -> None:
        res = self.resident.pop(key)
        self._clear_slot(res.slot)
        self._free_slots.append(res.slot)
        self.pool.free_run(res.first_page, res.num_pages)
        self.counters.count_eviction(key.adapter_id)

    def _clear_slot(self, slot: int) -> None:
        self.weights.generation += 1
        for layer in self.tables.ranks:
            for ranks in layer.values():
                ranks[slot] = 0
        for by_group in self.tables.g_offsets:
            for offsets in by_group.values():
                offsets[slot] = -1
        self.tables.dora_slots.discard(slot)
        self.vocab.clear(slot)
        if self.mirror is not None:
            self.mirror.update(self.tables, slot)

    # ---- pins and versions ----------------------------------------------------------------------------

    def pin(self, spec: AdapterSpec) -> None:
        self.resident[spec.key].pins += 1

    def unpin(self, spec: AdapterSpec) -> None:
        key = spec.key
        res = self.resident[key]
        assert res.pins > 0, f"adapter {key} unpinned more than pinned"
        res.pins -= 1
        if res.pins == 0 and res.stale:
            self._evict(key)

    def retire(self, adapter_id: str, keep_version: int | None = None) -> None:
        """Mark every version of `adapter_id` but `keep_version` stale; free the unpinned ones now."""
        for key, res in list(self.resident.items()):
            if key[0] == adapter_id and key[1] != keep_version:
                res.stale = True
                if res.pins == 0:
                    self._evict(key)

    def full(self) -> bool:
        return len(self.resident) >= self.max_adapters

    def idle_count(self) -> int:
        return sum(res.pins == 0 for res in self.resident.values())

    def idle_pages(self) -> int:
        """Pages that evicting every unpinned adapter would free (not necessarily contiguous)."""
        return sum(res.num_pages for res in self.resident.values() if res.pins == 0)

    @property
    def num_pages(self) -> int:
        return sum(res.num_pages for res in self.resident.values())
