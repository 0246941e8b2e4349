"""Weighted mixes of adapters, served as one derived adapter on the existing LoRA kernels.

A request may name a mix instead of one adapter (`support-v3*0.7+legal-tone*0.3`, loragate_common/adapter_mix.py).
A mix of plain LoRAs is exact as a concatenation of ranks: sum_i w_i * s_i * B_i A_i = B' A' with
A' = cat(A_i) and B' = cat(w_i * s_i * B_i) side by side along the rank, which is PEFT's
`add_weighted_adapter(adapters, weights, name, combination_type="cat")` (PEFT folds w_i * s_i into A_i and sets the
new adapter's scale to 1; the host tier's B already carries s_i, so w_i goes there too). The engine then serves it as
any adapter: the derived `AdapterSpec` has the union of its parts' (layer, module) targets, each with the sum of the
ranks that target it and scale 1.0, and the host tier builds its weights from the parts' (`mix_weights`) where an
adapter's would be read from its files (the one branch on `AdapterSpec.parts`).

Keys. The device tier, the host tier and the prefix cache key everything by `AdapterSpec.key`, so a derived spec is
one stable object per set of part versions, kept in a bounded LRU (`DerivedMixes`, inside the registry):
- its id is the mix's canonical name over the parts as requests name them (`mix_name`: parts sorted, shortest float
  repr), the name responses, metrics, the load report and the gateway's affinity routing all use;
- its version is given by the store once per distinct set of part versions (the canonical name written over the
  parts' registered versions, `a@3*0.7+b@1*0.3`, is the store's key) from one counter that never repeats, so a part
  registered again makes a new key and a mix built from its older content is never served with newer weights, nor
  the other way round. Registering or unloading a part retires the mixes built from its older versions
  (LLMEngine.retire_adapter), as a new version retires an adapter's old one.

What a mix cannot hold (AdapterError, a 400 naming the part): a DoRA part (its magnitude rescales the part's whole
output, W included, so it is no sum of low-rank deltas), a part with LoRA on embed_tokens or lm_head (those deltas
live outside the page pool's per-layer slots: not mixable yet). A mix whose summed ranks need more pages than the
pool holds is refused by the engine (LLMEngine.resolve_adapter).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from engine.lora.files import LoraWeights
from engine.lora.peft_config import MODULES, AdapterError, AdapterSpec, LoraTarget
from loragate_common.adapter_mix import MixPart, mix_name, parse_mix
from loragate_common.errors import ApiError, shown

MAX_DERIVED = 256  # derived specs kept (a few KB each); one rebuilt after eviction takes a new version
Parts = Sequence[tuple[AdapterSpec, float]]


class PartUnusable(AdapterError):
    """A mix's part whose own weights could not be loaded: that part version is broken, not the mix alone."""

    def __init__(self, part: AdapterSpec, message: str) -> None:
        super().__init__(message)
        self.part = part


def parse(name: str) -> tuple[MixPart, ...]:
    """The parts of a mix name, or AdapterError saying what is wrong (the engine's own callers pass names the HTTP
    layer already checked; a direct caller gets the same rules)."""
    try:
        return parse_mix(name, "adapter mix")
    except ApiError as exc:
        raise AdapterError(exc.message) from None


def canonical_name(parts: Parts) -> str:
    """The mix's id: its canonical name over the parts' registered ids."""
    return mix_name([MixPart(spec.adapter_id, weight) for spec, weight in parts])


def versioned_name(parts: Parts) -> str:
    """The canonical name over the parts' registered versions (`a@3*0.7+b@1*0.3`): one content per name."""
    return mix_name([MixPart(f"{spec.adapter_id}@{spec.version}", weight) for spec, weight in parts])


def check_mixable(mix_id: str, spec: AdapterSpec) -> None:
    """AdapterError naming the part if it cannot be served inside a mix."""
    if spec.dora:
        raise AdapterError(
            f"adapter mix {shown(mix_id)}: part {spec.adapter_id!r} is a DoRA adapter; DoRA rescales the whole "
            "output of each module it adapts, so it cannot be mixed as a concatenation of ranks"
        )
    if spec.vocab_modules:
        raise AdapterError(
            f"adapter mix {shown(mix_id)}: part {spec.adapter_id!r} adapts {', '.join(spec.vocab_modules)}; LoRA "
            "on the embedding or the LM head is not mixable yet (those deltas are kept outside the pool's per-layer "
            "slots that a mix concatenates)"
        )


def derive(mix_id: str, version: int, parts: Parts) -> AdapterSpec:
    """The derived adapter of `parts` (sorted by id): every target of a part, ranks summed where parts share one,
    scale 1.0 (the weights and the parts' scales are folded into B by `mix_weights`)."""
    num_layers = len(parts[0][0].layers)
    layers: tuple[dict[str, LoraTarget], ...] = tuple({} for _ in range(num_layers))
    for spec, _ in parts:
        if len(spec.layers) != num_layers:
            raise AdapterError(f"adapter mix {shown(mix_id)}: its parts were read for different base models")
        for layer, module, target in spec.targets():
            before = layers[layer].get(module)
            layers[layer][module] = LoraTarget((0 if before is None else before.rank) + target.rank, 1.0)
    return AdapterSpec(
        adapter_id=mix_id,
        version=version,
        path=Path(),  # a mix has no directory: its weights are built from its parts'
        layers=layers,
        modules=tuple(m for m in MODULES if any(m in by_module for by_module in layers)),
        max_rank=max(t.rank for by_module in layers for t in by_module.values()),
        num_params=sum(spec.num_params for spec, _ in parts),
        nbytes=sum(spec.nbytes for spec, _ in parts),
        stamp=(0, 0, 0),
        parts=tuple(parts),
    )


def mix_weights(spec: AdapterSpec, part_weights: Sequence[LoraWeights]) -> LoraWeights:
    """The derived adapter's A and scale-folded B from its parts' (`part_weights[i]` for `spec.parts[i]`, in the
    host tier's dtype): for each (layer, module), A = cat(A_i) and B = cat(w_i * B_i) along the rank, in the parts'
    order, laid out as `files.load_weights` lays an adapter out (one buffer, B.T contiguous)."""
    if [w.spec.key for w in part_weights] != [part.key for part, _ in spec.parts]:
        raise ValueError(f"weights given for mix {spec.adapter_id!r} are not its parts'")
    pieces = []  # (layer, module, [(A_i, B_i, w_i)])
    for layer, module, _ in spec.targets():
        found = [
            (*weights.layers[layer][module], weight)
            for weights, (_, weight) in zip(part_weights, spec.parts, strict=True)
            if module in weights.layers[layer]
        ]
        pieces.append((layer, module, found))
    dtype = pieces[0][2][0][0].dtype  # the host tier's: every part's weights are in it
    flat = torch.empty(sum(a.numel() + b.numel() for *_, found in pieces for a, b, _ in found), dtype=dtype)
    layers: tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], ...] = tuple({} for _ in spec.layers)
    offset = 0
    for layer, module, found in pieces:
        rank = sum(a.shape[0] for a, _, _ in found)
        in_features, out_features = found[0][0].shape[1], found[0][1].shape[0]
        a_out = flat[offset : offset + rank * in_features].view(rank, in_features)
        offset += rank * in_features
        b_rows = flat[offset : offset + rank * out_features].view(rank, out_features)  # B.T, see LoraWeights
        offset += rank * out_features
        row = 0
        for a, b, weight in found:
            a_out[row : row + a.shape[0]].copy_(a)
            torch.mul(b.t(), weight, out=b_rows[row : row + a.shape[0]])
            row += a.shape[0]
        layers[layer][module] = (a_out, b_rows.t())
    if flat.numel() and not all(bool(torch.isfinite(v)) for v in torch.aminmax(flat)):
        raise AdapterError(f"adapter mix {spec.adapter_id!r}: its weighted B has non-finite values in {dtype}")
    return LoraWeights(spec=spec, layers=layers, nbytes=flat.numel() * flat.element_size())


class DerivedMixes:
    """The derived specs of recent mixes, least recently used evicted first, keyed by the canonical name over their
    parts' versions. Not thread-safe: the registry calls it under its lock."""

    def __init__(self, capacity: int = MAX_DERIVED) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, AdapterSpec] = OrderedDict()
        self._newest: dict[str, str] = {}  # mix id -> the key of its newest entry (what residence reports)
        self._next_version = 1  # one counter for every mix: a version is never given twice
        self.builds = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, parts: Parts) -> AdapterSpec:
        """The derived spec of these part versions and weights (in any order): the same object while kept."""
        ordered = sorted(parts, key=lambda item: item[0].adapter_id)
        key = versioned_name(ordered)
        spec = self._entries.get(key)
        if spec is not None:
            self._entries.move_to_end(key)
            return spec
        mix_id = canonical_name(ordered)
        for part, _ in ordered:
            check_mixable(mix_id, part)
        spec = derive(mix_id, self._next_version, ordered)
        self._next_version += 1
        self.builds += 1
        self._entries[key] = spec
        self._newest[mix_id] = key
        while len(self._entries) > self.capacity:
            old_key, old = self._entries.popitem(last=False)
            self._forget(old_key, old)
        return spec

    def newest(self, mix_id: str) -> AdapterSpec | None:
        """The most recently built spec of a mix id that is still kept."""
        key = self._newest.get(mix_id)
        return None if key is None else self._entries.get(key)

    def retire(self, part_id: str, is_current: Callable[[AdapterSpec], bool]) -> dict[str, int | None]:
        """Drop the specs built from a version of `part_id` that is no longer current; {mix id: the version of it to
        keep (all its parts current) or None} for every kept mix that has `part_id` as a part."""
        keep: dict[str, int | None] = {}
        for key, spec in list(self._entries.items()):
            if not any(part.adapter_id == part_id for part, _ in spec.parts):
                continue
            if all(is_current(part) for part, _ in spec.parts):
                keep[spec.adapter_id] = spec.version
                continue
            del self._entries[key]
            self._forget(key, spec)
            keep.setdefault(spec.adapter_id, None)
        return keep

    def _forget(self, key: str, spec: AdapterSpec) -> None:
        if self._newest.get(spec.adapter_id) == key:
            del self._newest[spec.adapter_id]
