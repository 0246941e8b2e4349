"""One step's LoRA work: which rows use which adapter slot, and where the slots' weights sit in the pool.

The runner groups a step's rows into segments by adapter slot (`LoraBatch`); the model asks it for each
layer's deltas, one call per fused projection (`LoraBatch.layer(i).linear(group, proj, x)`,
engine/model/llama.py's `LoraDelta` protocol), and the SGMV kernels add them, reading A and scale-folded B
straight from the unified page pool through the slot tables the device tier (engine/lora/device_tier.py)
keeps: the torch twin (loragate_kernels/reference.py, the CPU path) from Python lists, the Triton kernels
(loragate_kernels/sgmv.py, CUDA) from the tier's device mirror of the same tables, with row tiles planned once per
step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.lora.peft_config import GROUPS, module_features
from engine.model.config import ModelConfig
from engine.model.cpu_gemm import PackedLinear
from loragate_kernels.cpu_ops import lora_sgmv_group_cpu
from loragate_kernels.reference import lora_bmm_group, lora_sgmv_group


@dataclass(slots=True)
class SlotTables:
    """Per layer, indexed by slot: each group's stacked-A offset, each module's rank and B offset.

    A slot's region in a layer holds, group by group (GROUPS order), the A [r, in] of every module it
    targets stacked in module order, then those modules' B transposed, [r, out] (loragate_kernels/reference.py). Rank 0
    means the slot's adapter does not target that module in that layer, or the slot is empty (always so for the
    null slot).
    """

    a_offsets: list[dict[str, list[int]]]  # [layer][group][slot]
    b_offsets: list[dict[str, list[int]]]  # [layer][module][slot]
    ranks: list[dict[str, list[int]]]  # [layer][module][slot]

    @classmethod
    def empty(cls, num_layers: int, num_slots: int) -> SlotTables:
        modules = [m for names in GROUPS.values() for m in names]
        return cls(
            [{g: [0] * num_slots for g in GROUPS} for _ in range(num_layers)],
            [{m: [0] * num_slots for m in modules} for _ in range(num_layers)],
            [{m: [0] * num_slots for m in modules} for _ in range(num_layers)],
        )


def group_out_cols(model: ModelConfig) -> dict[str, list[int]]:
    """Each group's column boundaries in its fused output: [0, out_1, out_1 + out_2, ...]."""
    cols = {}
    for group, names in GROUPS.items():
        bounds = [0]
        for module in names:
            bounds.append(bounds[-1] + module_features(model, module)[1])
        cols[group] = bounds
    return cols


def group_in_features(model: ModelConfig) -> dict[str, int]:
    """The input width every module of a group shares."""
    return {group: module_features(model, names[0])[0] for group, names in GROUPS.items()}


@dataclass(slots=True)
class PoolWeights:
    """Where the device tier keeps adapter weights: one flat view of the pool per layer
    ([num_pages * page_elems]), the slot tables into it, and (for the Triton kernels) their device mirror."""

    layer_pools: list[torch.Tensor]
    tables: SlotTables
    out_cols: dict[str, list[int]]
    in_features: dict[str, int]
    mirror: Any = None  # engine.lora.device_tier.DeviceMirror, when the Triton kernels are in use
    max_rank: dict[str, int] = field(default_factory=lambda: dict.fromkeys(GROUPS, 0))  # over loads, per group
    generation: int = 0  # bumped whenever a slot's contents change (what engine/lora/stacks.py keys its copy on)


@dataclass(slots=True)  # not frozen: one is made per step, and frozen makes __init__ several times slower
class LoraBatch:
    """One step's adapter segments: rows [seg_starts[s], seg_starts[s+1]) use slot seg_slots[s].

    `plan` is set when the Triton kernels run: the step's row tiles, built once and shared by all layers.
    `segments` is set when the CPU's C++ op runs (loragate_kernels/cpu_ops.py), `stacked` on the CPU's torch path when
    the step's adapters are computed all at once (engine/lora/stacks.py).
    """

    seg_starts: list[int]
    seg_slots: list[int]
    weights: PoolWeights
    plan: Any = None  # loragate_kernels.sgmv.SgmvPlan
    stacked: Any = None  # engine.lora.stacks.StackPlan
    segments: torch.Tensor | None = None  # the C++ op's seg_starts then seg_slots, one int64 tensor
    # the Triton kernels' rank bound per group (None: weights.max_rank); a captured graph's is larger
    max_rank: dict[str, int] | None = None

    def layer(self, index: int) -> LayerLora:
        return LayerLora(self, index)


@dataclass(slots=True)  # made per layer per step (not frozen, as LoraBatch)
class LayerLora:
    batch: LoraBatch
    index: int

    def linear(self, group: str, proj: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """proj(x) plus the group's deltas: one op where proj's GEMM route fuses them (the CPU's C++ GEMMs with the
        C++ LoRA op: engine/model/cpu_gemm.py PackedLinear `fused_lora`), else proj(x) and then `apply`."""
        batch, w, i = self.batch, self.batch.weights, self.index
        if batch.segments is not None and isinstance(proj, PackedLinear):
            y = proj.fused_lora(x, batch.segments, w.layer_pools[i], w.mirror.blocks[i][group], w.out_cols[group])
            if y is not None:
                return y
        y = proj(x)
        self.apply(group, y, x)
        return y

    def apply(self, group: str, y: torch.Tensor, x: torch.Tensor) -> None:
        """y [T, out] += the batch's LoRA deltas for the group's modules in this layer; x [T, in]."""
        batch, w, i = self.batch, self.batch.weights, self.index
        if batch.plan is not None:
            from loragate_kernels.sgmv import lora_sgmv_group_triton

            mirror = w.mirror
            lora_sgmv_group_triton(
                y,
                x,
                batch.plan,
                w.layer_pools[i],
                mirror.tables[i][group],
                mirror.out_cols[group],
                mirror.n_tiles[group],
                (w.max_rank if batch.max_rank is None else batch.max_rank)[group],
            )
            return
        if batch.segments is not None:  # CPU, the C++ op (loragate_kernels/cpu_ops.py)
            lora_sgmv_group_cpu(y, x, batch.segments, w.layer_pools[i], w.mirror.blocks[i][group], w.out_cols[group])
            return
        if batch.stacked is not None:
            stack = batch.stacked.stack
            lora_bmm_group(
                y,
                x,
                batch.stacked.gather,
                batch.stacked.mask,
                stack.a[i][group],
                stack.b[i][group],
                stack.h_cols[group],
                w.out_cols[group],
            )
            return
        names = GROUPS[group]
        lora_sgmv_group(
            y,
            x,
            batch.seg_starts,
            batch.seg_slots,
            w.layer_pools[i],
            w.tables.a_offsets[i][group],
            [w.tables.ranks[i][m] for m in names],
            [w.tables.b_offsets[i][m] for m in names],
            w.out_cols[group],
        )
