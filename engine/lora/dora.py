"""DoRA (weight-decomposed LoRA, PEFT's `use_dora`) on the engine's batched LoRA.

PEFT computes a DoRA module as

    y = g ⊙ (W x + s B A x) + bias,    g = m / ‖W + s B A‖  (per output row; the norm is a constant, detached)

with m the adapter's saved magnitude. W is the shared base weight, so g is one vector per adapter and module, fixed
once the adapter's weights are: the device tier computes it when it writes the adapter into the page pool
(`DoraNorms.scales`) and keeps it there beside A and B, one vector per layer and module group over the group's output
columns, 1.0 in the columns of a module the adapter does not target (engine/lora/tables.py `SlotTables.g_offsets`).
The host tier keeps m (engine/lora/files.py `LoraWeights.magnitudes`): g depends on the base, which is where the
device tier is. A step computes a group's output as for any LoRA, on any route (the base projection plus the deltas),
and then rescales its DoRA rows: y <- g ⊙ y + (1 - g) ⊙ bias, which is g ⊙ (W x + s B A x) + bias (`DoraScaler`, one
implementation for every route; loragate_kernels/reference.py `dora_scale_group` is its per-segment oracle).

The base's side without its plain weights (the CPU's GEMM routes keep only a packed copy, engine/model/cpu_gemm.py):
‖W_o + (B_s A)_o‖² = ‖W_o‖² + 2 (W Aᵀ)_o · B_s,o + ‖(B_s A)_o‖², with B_s the scale-folded B, W Aᵀ the projection of
A's rows less the bias (one GEMM of r rows through the group's fused projection) and ‖W_o‖² the base's squared row
norms, taken from the plain weights before they are packed (`row_norms`, called by
engine/model/decoder.py CausalLM.prepack) or read from a projection that keeps its weight.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from torch import nn

from engine.lora.peft_config import GROUPS, AdapterError, AdapterSpec, module_name
from engine.lora.tables import PoolWeights, group_out_cols
from engine.model.config import ModelConfig


class BaseModel(Protocol):
    """What DoRA reads of the base model (engine/model/decoder.py CausalLM, which imports this module)."""

    config: ModelConfig
    layers: nn.ModuleList
    dora_row_norms: list[dict[str, torch.Tensor]] | None


# A step's DoRA rows up to this span gather their scales row by row (one op per group); a longer span (a prompt chunk)
# scales segment by segment, without a [rows, out] copy of the scales.
GATHER_ROWS = 64


_GROUP_PATHS = {
    "qkv": "self_attn.qkv_proj",
    "o": "self_attn.o_proj",
    "gate_up": "mlp.gate_up_proj",
    "down": "mlp.down_proj",
}


def group_projections(model: BaseModel) -> list[dict[str, nn.Module]]:
    """Each layer's projection per module group (GROUPS): the fused q|k|v, o, gate|up and down."""
    return [{group: layer.get_submodule(path) for group, path in _GROUP_PATHS.items()} for layer in model.layers]


def _tensor(proj: nn.Module, name: str) -> torch.Tensor | None:
    """A projection's weight or bias (nn.Linear's, or the packed layout's, engine/model/cpu_gemm.py)."""
    value = getattr(proj, name, None)
    assert value is None or isinstance(value, torch.Tensor)
    return value


def _weight(proj: nn.Module) -> torch.Tensor:
    weight = _tensor(proj, "weight")
    assert weight is not None
    return weight


def _row_norms_sq(weight: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(weight, dim=1, dtype=torch.float32).square()


def row_norms(model: BaseModel) -> list[dict[str, torch.Tensor]]:
    """The squared row norms of every group projection's plain weight ([layer][group] fp32 [out]), for DoRA: taken by
    CausalLM.prepack before the GEMM route lays the weights out in a form they cannot be read back from. One pass over
    the weights."""
    return [
        {group: _row_norms_sq(_weight(proj)) for group, proj in layer.items()} for layer in group_projections(model)
    ]


class DoraNorms:
    """The base model's side of DoRA: the row scales g of an adapter's modules, from the model's own projections."""

    def __init__(self, model: BaseModel) -> None:
        self.projections = group_projections(model)
        self.out_cols = group_out_cols(model.config)
        # taken before packing (CausalLM.prepack), else filled here from the projections' own weights on first use
        self._row_norms = model.dora_row_norms or [{} for _ in self.projections]

    def row_norms_sq(self, layer: int, group: str) -> torch.Tensor:
        """‖W_o‖² of the group's fused projection, fp32 [out], on the weights' device."""
        found = self._row_norms[layer].get(group)
        if found is None:
            proj = self.projections[layer][group]
            if not isinstance(proj, nn.Linear):  # packed, and nothing recorded before: not loaded by the loader
                raise RuntimeError("DoRA needs the base's row norms, taken by CausalLM.prepack before packing")
            found = self._row_norms[layer][group] = _row_norms_sq(proj.weight)
        return found

    @torch.no_grad()
    def scales(
        self,
        spec: AdapterSpec,
        layer: int,
        group: str,
        modules: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """g [out] fp32 on the CPU over the group's columns in `layer`, for the adapter's `modules` of the group, each
        (A [r, in], B_scaled [out_m, r], magnitude [out_m]) as the host tier holds them; 1.0 in the columns of the
        group's other modules. AdapterError naming the module where g is not finite (a row of W + s B A of norm 0)."""
        names, cols = GROUPS[group], self.out_cols[group]
        proj = self.projections[layer][group]
        weight, bias = _weight(proj), _tensor(proj, "bias")
        targeted = [m for m in names if m in modules]
        a_all = torch.cat([modules[m][0] for m in targeted]).to(weight.device)
        wa = proj(a_all).float()  # [R, out]: A W^T + bias, every targeted module's A through the fused projection
        if bias is not None:
            wa -= bias.float()
        norms_sq = self.row_norms_sq(layer, group)
        g = torch.ones(cols[-1], dtype=torch.float32, device=weight.device)
        row = 0
        for i, module in enumerate(names):
            if module not in modules:
                continue
            a, b, magnitude = (t.to(weight.device, torch.float32) for t in modules[module])
            lo, hi, rank = cols[i], cols[i + 1], a.shape[0]
            cross = (wa[row : row + rank, lo:hi].t() * b).sum(1)  # (W A^T)_o . B_s,o
            row += rank
            lora_sq = ((b @ (a @ a.t())) * b).sum(1)  # ‖(B_s A)_o‖²
            g[lo:hi] = magnitude / (norms_sq[lo:hi] + 2 * cross + lora_sq).clamp_min(0).sqrt()
            if not bool(torch.isfinite(g[lo:hi]).all()):
                raise AdapterError(
                    f"adapter {spec.adapter_id!r}: the DoRA scale of {module_name(layer, module)} is not finite (a row "
                    "of its adapted weight has norm 0)"
                )
        return g.cpu()


@dataclass(slots=True)
class DoraStack:
    """A step's DoRA adapters' row scales per layer and group, [U + 1, out]: row u is the u-th slot of `slots`, the
    last row ones (rows of the span without DoRA, and a slot without scales in that layer and group). A derived copy
    of the pool's, as engine/lora/stacks.py's: kept while the step's DoRA adapters and the tier's contents stay."""

    key: tuple[tuple[int, ...], int]  # (the slots in stack order, the tier's generation)
    g: list[dict[str, torch.Tensor]]  # [layer][group]
    # (layer, group) -> (the bias, (1 - g) ⊙ bias), made on first use by a projection with a bias
    offsets: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def entry(self, slot: int) -> int:
        return self.key[0].index(slot)

    def offset(self, layer: int, group: str, bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        found = self.offsets.get((layer, group))
        if found is None or found[0] is not bias:
            offset = ((1 - self.g[layer][group].float()) * bias.float()).to(dtype)
            found = self.offsets[(layer, group)] = (bias, offset)
        return found[1]


@dataclass(slots=True)
class DoraPlan:
    """One step's DoRA rows: the span from the first to the last, and either each row's stack entry (`index`, a short
    span: decodes) or the segments (first row, end row, stack entry) to scale one by one (a prompt chunk)."""

    stack: DoraStack
    span: slice
    index: torch.Tensor | None
    segments: list[tuple[int, int, int]]

    def apply(self, layer: int, group: str, y: torch.Tensor, bias: torch.Tensor | None) -> None:
        """y [T, out] (the group's output: base plus LoRA deltas) <- g ⊙ y + (1 - g) ⊙ bias on the DoRA rows."""
        g = self.stack.g[layer][group]
        offset = None if bias is None else self.stack.offset(layer, group, bias, y.dtype)
        if self.index is not None:
            rows = y[self.span]
            rows.mul_(g.index_select(0, self.index))
            if offset is not None:
                rows.add_(offset.index_select(0, self.index))
            return
        for lo, hi, u in self.segments:
            y[lo:hi].mul_(g[u])
            if offset is not None:
                y[lo:hi].add_(offset[u])


class DoraScaler:
    """Plans a step's DoRA rows (`plan`) over the stack of its DoRA adapters' scales, which it keeps between steps."""

    def __init__(self, weights: PoolWeights) -> None:
        self.weights = weights
        self.current: DoraStack | None = None
        self.builds = 0  # how many stacks were built (tests)

    def plan_segments(self, seg_starts: list[int], seg_slots: list[int]) -> DoraPlan | None:
        """`plan` for the route's segments; None (at once) when no segment's slot holds a DoRA adapter."""
        dora = self.weights.tables.dora_slots
        if not dora or dora.isdisjoint(seg_slots):
            return None
        return self.plan(zip(seg_slots, seg_starts, seg_starts[1:], strict=False))

    def plan(self, spans: Iterable[tuple[int, int, int]]) -> DoraPlan | None:
        """The DoRA rows of a step whose rows [lo, hi) use slot k, for each (k, lo, hi) of `spans`; None if none."""
        dora = self.weights.tables.dora_slots
        segments = sorted((lo, hi, k) for k, lo, hi in spans if hi > lo and k in dora)
        if not segments:
            return None
        stack = self._stack(tuple(sorted({k for *_, k in segments})))
        first, end = segments[0][0], segments[-1][1]
        entries = [(lo, hi, stack.entry(k)) for lo, hi, k in segments]
        if end - first > GATHER_ROWS:
            return DoraPlan(stack, slice(first, end), None, entries)
        index = [len(stack.key[0])] * (end - first)  # the ones row, where a row of the span has no DoRA
        for lo, hi, u in entries:
            index[lo - first : hi - first] = [u] * (hi - lo)
        device = self.weights.layer_pools[0].device
        return DoraPlan(stack, slice(first, end), torch.tensor(index, dtype=torch.int64, device=device), entries)

    def _stack(self, slots: tuple[int, ...]) -> DoraStack:
        generation = self.weights.generation
        current = self.current
        if current is not None and current.key[1] == generation:
            kept = current.key[0]
            # the same adapters, or a few more (a request finished): reused rather than copied again
            if kept == slots or (set(slots) <= set(kept) and len(kept) <= 2 * len(slots)):
                return current
        self.current = None
        layers = [self._stack_layer(i, slots) for i in range(len(self.weights.layer_pools))]
        self.current = DoraStack((slots, generation), layers)
        self.builds += 1
        return self.current

    def _stack_layer(self, layer: int, slots: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """One layer's [U + 1, out] per group: ones, then each slot's scales gathered from the pool in one copy."""
        pool = self.weights.layer_pools[layer]
        offsets = self.weights.tables.g_offsets[layer]
        widths = {group: cols[-1] for group, cols in self.weights.out_cols.items()}
        flat = torch.ones(sum((len(slots) + 1) * w for w in widths.values()), dtype=pool.dtype, device=pool.device)
        sources, targets, lengths = [], [], []
        start = 0
        for group, width in widths.items():
            for u, slot in enumerate(slots):
                if offsets[group][slot] >= 0:
                    sources.append(offsets[group][slot])
                    targets.append(start + u * width)
                    lengths.append(width)
            start += (len(slots) + 1) * width
        if lengths:
            src, dst = (torch.from_numpy(_ranges(s, lengths)).to(pool.device) for s in (sources, targets))
            flat[dst] = pool[src]
        out, start = {}, 0
        for group, width in widths.items():
            out[group] = flat[start : start + (len(slots) + 1) * width].view(len(slots) + 1, width)
            start += (len(slots) + 1) * width
        return out


def _ranges(starts: list[int], lengths: list[int]) -> np.ndarray:
    """The concatenation of range(s, s + n) for each (s, n), as int64, without a Python loop over elements."""
    n = np.asarray(lengths, dtype=np.int64)
    shift = np.asarray(starts, dtype=np.int64) - (np.cumsum(n) - n)
    return np.repeat(shift, n) + np.arange(int(n.sum()), dtype=np.int64)
