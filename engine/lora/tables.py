"""Where the device tier's adapters sit in the unified page pool: per layer and slot, each group's stacked-A offset and
each module's rank and B offset, and a DoRA adapter's row scales (`SlotTables`, kept by engine/lora/device_tier.py), and
what a step's LoRA route reads (`PoolWeights`: the pool's per-layer views, those tables and, for the C++ and Triton
routes, their tensor mirror). engine/lora/routes.py computes a step's deltas from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.lora.peft_config import GROUPS, module_features
from engine.model.config import ModelConfig


@dataclass(slots=True)
class SlotTables:
    """Per layer, indexed by slot: each group's stacked-A offset, each module's rank and B offset, each group's DoRA
    row scales.

    A slot's region in a layer holds, group by group (GROUPS order), the A [r, in] of every module it
    targets stacked in module order, then those modules' B transposed, [r, out] (loragate_kernels/reference.py), then,
    for a DoRA adapter, the group's row scales g [out_cols[-1]] (engine/lora/dora.py: 1.0 in the columns of a module
    it does not target). Rank 0 means the slot's adapter does not target that module in that layer, or the slot is
    empty (always so for the null slot); a g offset of -1, that the slot has no DoRA scales in that layer and group.
    """

    a_offsets: list[dict[str, list[int]]]  # [layer][group][slot]
    b_offsets: list[dict[str, list[int]]]  # [layer][module][slot]
    ranks: list[dict[str, list[int]]]  # [layer][module][slot]
    g_offsets: list[dict[str, list[int]]] = field(default_factory=list)  # [layer][group][slot]; -1: none
    dora_slots: set[int] = field(default_factory=set)  # the slots holding a DoRA adapter

    @classmethod
    def empty(cls, num_layers: int, num_slots: int) -> SlotTables:
        modules = [m for names in GROUPS.values() for m in names]
        return cls(
            [{g: [0] * num_slots for g in GROUPS} for _ in range(num_layers)],
            [{m: [0] * num_slots for m in modules} for _ in range(num_layers)],
            [{m: [0] * num_slots for m in modules} for _ in range(num_layers)],
            [{g: [-1] * num_slots for g in GROUPS} for _ in range(num_layers)],
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
    ([num_pages * page_elems]), the slot tables into it, and (for the C++ and Triton routes) their tensor mirror."""

    layer_pools: list[torch.Tensor]
    tables: SlotTables
    out_cols: dict[str, list[int]]
    in_features: dict[str, int]
    mirror: DeviceMirror | None = None  # the tables as tensors, for the C++ and Triton routes
    max_rank: dict[str, int] = field(default_factory=lambda: dict.fromkeys(GROUPS, 0))  # over loads, per group
    generation: int = 0  # bumped whenever a slot's contents change (what engine/lora/stacks.py keys its copy on)


class DeviceMirror:
    """The slot tables as device tensors, one loragate_kernels.triton.sgmv.GroupTables per (layer, group), plus the
    static column tiles of each group: what the Triton kernels read. Every table is a view of one int64 tensor
    [layers, groups, FIELDS, slots], so a load or an eviction rewrites one slot's column with one host-to-device
    copy (a table of a few hundred ints built on the host), not several per layer and group; nothing is rebuilt
    per step."""

    MODULES = max(len(names) for names in GROUPS.values())
    # rows of a (layer, group)'s block: a_offsets, ranks[M], b_offsets[M], h_cols[M], rank_total
    FIELDS = 2 + 3 * MODULES

    def __init__(self, num_layers: int, num_slots: int, out_cols: dict[str, list[int]], device: torch.device) -> None:
        from loragate_kernels.triton.sgmv import GroupTables, column_tiles

        m = self.MODULES
        self.packed = torch.zeros(num_layers, len(GROUPS), self.FIELDS, num_slots, dtype=torch.int64, device=device)
        self.tables = [
            {
                group: GroupTables(
                    block[0],
                    block[1 : 1 + len(names)],
                    block[1 + m : 1 + m + len(names)],
                    block[1 + 2 * m : 1 + 2 * m + len(names)],
                    block[1 + 3 * m],
                )
                for block, (group, names) in zip(self.packed[layer], GROUPS.items(), strict=True)
            }
            for layer in range(num_layers)
        ]
        # the same blocks whole, [FIELDS, slots] each: the CPU's C++ op takes one (loragate_kernels/cpu/ops.py)
        self.blocks = [dict(zip(GROUPS, self.packed[layer], strict=True)) for layer in range(num_layers)]
        # SlotTables.g_offsets, [layers, groups, slots]: the CPU's DoRA op takes one (layer, group)'s row
        self.g_packed = torch.full((num_layers, len(GROUPS), num_slots), -1, dtype=torch.int64, device=device)
        self.g_offsets = [dict(zip(GROUPS, self.g_packed[layer], strict=True)) for layer in range(num_layers)]
        self.out_cols = {g: torch.tensor(cols, dtype=torch.int32, device=device) for g, cols in out_cols.items()}
        self.n_tiles = {g: column_tiles(cols, device) for g, cols in out_cols.items()}

    def update(self, tables: SlotTables, slot: int) -> None:
        """Copy slot `slot`'s entries of `tables` (every layer and group) to the device, in one copy."""
        m = self.MODULES
        column = torch.zeros(self.packed.shape[:3], dtype=torch.int64)  # [layers, groups, FIELDS] on the host
        rows = column.numpy()
        for layer in range(self.packed.shape[0]):
            for g, (group, names) in enumerate(GROUPS.items()):
                ranks = [tables.ranks[layer][name][slot] for name in names]
                block = rows[layer, g]
                block[0] = tables.a_offsets[layer][group][slot]
                for i, name in enumerate(names):
                    block[1 + i] = ranks[i]
                    block[1 + m + i] = tables.b_offsets[layer][name][slot]
                    block[1 + 2 * m + i] = sum(ranks[:i])  # where module i's rank block starts in h
                block[1 + 3 * m] = sum(ranks)
        self.packed[..., slot].copy_(column)
        offsets = [[tables.g_offsets[layer][group][slot] for group in GROUPS] for layer in range(len(tables.g_offsets))]
        self.g_packed[..., slot].copy_(torch.tensor(offsets, dtype=torch.int64))
