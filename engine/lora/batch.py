"""One step's LoRA work: which rows use which adapter slot, and where the slots' weights sit in the pool.

The runner groups a step's rows into segments by adapter slot (`LoraBatch`); the model asks it for each
layer's deltas (`LoraBatch.layer(i).apply(module, y, x)`, engine/model/llama.py's `LoraDelta` protocol)
and the torch SGMV twin (kernels/reference.py) adds them, reading A and scale-folded B straight from the
unified page pool through the slot tables the device tier (engine/lora/device_tier.py) keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.reference import lora_sgmv


@dataclass(slots=True)
class SlotTables:
    """Per layer and module, indexed by slot: where A and B start in that layer's pool, and the rank.

    rank 0 means the slot's adapter does not target that module in that layer, or the slot is empty
    (always so for the null slot).
    """

    a_offsets: list[dict[str, list[int]]]
    b_offsets: list[dict[str, list[int]]]
    ranks: list[dict[str, list[int]]]


@dataclass(frozen=True, slots=True)
class PoolWeights:
    """Where the device tier keeps adapter weights: one flat view of the pool per layer
    ([num_pages * page_elems]) and the slot tables into it."""

    layer_pools: list[torch.Tensor]
    tables: SlotTables


@dataclass(frozen=True, slots=True)
class LoraBatch:
    """One step's adapter segments: rows [seg_starts[s], seg_starts[s+1]) use slot seg_slots[s]."""

    seg_starts: list[int]
    seg_slots: list[int]
    weights: PoolWeights

    def layer(self, index: int) -> LayerLora:
        return LayerLora(self, index)


@dataclass(frozen=True, slots=True)
class LayerLora:
    batch: LoraBatch
    index: int

    def apply(self, module: str, y: torch.Tensor, x: torch.Tensor) -> None:
        """y += the batch's LoRA deltas for `module` of this layer; y [T, out] (a view), x [T, in]."""
        weights, i = self.batch.weights, self.index
        lora_sgmv(y, x, self.batch.seg_starts, self.batch.seg_slots, weights.layer_pools[i],
                  weights.tables.a_offsets[i][module], weights.tables.b_offsets[i][module],
                  weights.tables.ranks[i][module])
