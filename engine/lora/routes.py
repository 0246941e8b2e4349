"""How a step's LoRA deltas are computed: one class per route, chosen once by loragate_kernels/backends.py
(`Backends.lora`), each with one interface.

The runner groups a step's rows into segments by adapter slot and asks the engine's route to `plan` them, once per
step; the model then asks for each layer's deltas, one call per fused projection (`LoraBatch.layer(i).linear(group,
proj, x)`, engine/model/decoder.py's `LoraDelta` protocol), and the route adds them with `apply`, reading A and
scale-folded B straight from the unified page pool through the slot tables the device tier keeps
(engine/lora/tables.py):

- `CppLora` (CPU): loragate_kernels/cpu/lora.cpp over the tier's tensor mirror of the tables; where the projection's
  GEMM has a fused twin (engine/model/cpu_gemm.py `PackedLinear.fused_lora`), the GEMM and the deltas are one op.
- `TorchLora` (CPUs where the C++ ops cannot be built): the torch twins (loragate_kernels/reference.py), per segment
  from the Python tables, or, for a decoding step, every adapter at once over a stacked copy (engine/lora/stacks.py).
- `TritonLora` (CUDA; CPU tensors under Triton's interpreter): the shrink and expand kernels
  (loragate_kernels/triton/sgmv.py) over the tier's device mirror, with the step's row tiles planned once.

A DoRA adapter's rows are rescaled after their group's output is computed (`LayerLora.linear`, `rescale`): on the
torch and Triton routes by engine/lora/dora.py's `DoraScaler` (torch ops over a stack of the step's scales), on the C++
route by loragate_kernels/cpu/lora.cpp's `dora_scale_group`, one call per group reading the scales from the pool.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import torch
from torch import nn

from engine.lora.dora import DoraScaler
from engine.lora.peft_config import GROUPS
from engine.lora.stacks import LoraStacks, StackPlan
from engine.lora.tables import DeviceMirror, PoolWeights
from engine.lora.vocab_lora import VocabStep
from engine.model.cpu_gemm import PackedLinear
from loragate_kernels.backends import Kernel
from loragate_kernels.cpu.ops import dora_scale_group_cpu, lora_sgmv_group_cpu
from loragate_kernels.reference import lora_bmm_group, lora_sgmv_group

PlanT = TypeVar("PlanT")
STACK_MAX_BYTES = 512 << 20  # the torch route's copy of one step's adapters (engine/lora/stacks.py)


class LoraRoute(ABC, Generic[PlanT]):
    """`plan` a step's segments once (rows [seg_starts[s], seg_starts[s + 1]) use slot seg_slots[s]; rows of
    `null_slot` have no adapter), then `apply` each layer's group deltas with that plan."""

    kernel: ClassVar[Kernel]
    mirror: ClassVar[bool] = False  # reads the device tier's tensor mirror of the slot tables

    def __init__(self, weights: PoolWeights) -> None:
        self.weights = weights
        self.dora = DoraScaler(weights)  # DoRA's row scales, the same on every route (engine/lora/dora.py)

    @abstractmethod
    def plan(self, seg_starts: list[int], seg_slots: list[int], null_slot: int) -> PlanT: ...

    @abstractmethod
    def apply(self, plan: PlanT, layer: int, group: str, y: torch.Tensor, x: torch.Tensor) -> None:
        """y [T, out] += the step's LoRA deltas for the group's modules in `layer`; x [T, in]."""

    def linear(self, plan: PlanT, layer: int, group: str, proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """proj(x) plus the group's deltas."""
        y = proj(x)
        self.apply(plan, layer, group, y, x)
        return y

    def step(self, seg_starts: list[int], seg_slots: list[int], null_slot: int) -> LoraBatch:
        plan = self.plan(seg_starts, seg_slots, null_slot)
        return LoraBatch(self, plan, self.dora_plan(seg_starts, seg_slots))

    def dora_plan(self, seg_starts: list[int], seg_slots: list[int]) -> Any:
        """The step's DoRA rows as `rescale` reads them; None (the common case, checked at once) when it has none."""
        return self.dora.plan_segments(seg_starts, seg_slots)

    def rescale(
        self, plan: PlanT, dora: Any, layer: int, group: str, y: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        """y [T, out] (the group's output with its deltas) <- g * y + (1 - g) * bias on the step's DoRA rows."""
        dora.apply(layer, group, y, bias)

    def _mirror(self) -> DeviceMirror:
        assert self.weights.mirror is not None, f"the {self.kernel.value} route reads the tier's mirror"
        return self.weights.mirror


@dataclass(slots=True)  # not frozen: one is made per step, and frozen makes __init__ several times slower
class LoraBatch:
    """One step's LoRA as the model sees it (engine/model/decoder.py `LoraDelta`): a route and its plan of the step,
    and the step's DoRA rows (None: it has none)."""

    route: LoraRoute[Any]
    plan: Any
    dora: Any = None  # LoraRoute.dora_plan's
    vocab: VocabStep | None = None  # the step's embedding and LM-head LoRA (engine/lora/vocab_lora.py), if any

    def layer(self, index: int) -> LayerLora:
        return LayerLora(self.route, self.plan, index, self.dora)

    def embed(self, input_ids: torch.Tensor, h: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """The step's embeddings h [T, hidden] with each row's embedding LoRA added (`VocabStep.embed`)."""
        return h if self.vocab is None else self.vocab.embed(input_ids, h, scale)


@dataclass(slots=True)  # made per layer per step (not frozen, as LoraBatch)
class LayerLora:
    route: LoraRoute[Any]
    plan: Any
    index: int
    dora: Any = None

    def linear(self, group: str, proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = self.route.linear(self.plan, self.index, group, proj, x)
        if self.dora is not None:  # DoRA rows: base plus deltas, rescaled by their adapter's row scales
            self.route.rescale(self.plan, self.dora, self.index, group, y, getattr(proj, "bias", None))
        return y


class CppLora(LoraRoute[torch.Tensor]):
    """The plan is the segments as one int64 tensor (starts, then slots), made once for every layer."""

    kernel = Kernel.CPP
    mirror = True

    def plan(self, seg_starts: list[int], seg_slots: list[int], null_slot: int) -> torch.Tensor:
        return torch.tensor(seg_starts + seg_slots, dtype=torch.int64)

    def dora_plan(self, seg_starts: list[int], seg_slots: list[int]) -> bool | None:
        """True where a segment's slot holds a DoRA adapter: the C++ op reads the segments and scales as they lie."""
        dora = self.weights.tables.dora_slots
        return True if dora and not dora.isdisjoint(seg_slots) else None

    def rescale(
        self, plan: torch.Tensor, dora: Any, layer: int, group: str, y: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        pool, offsets = self.weights.layer_pools[layer], self._mirror().g_offsets[layer][group]
        dora_scale_group_cpu(y, plan, pool, offsets, bias)

    def apply(self, plan: torch.Tensor, layer: int, group: str, y: torch.Tensor, x: torch.Tensor) -> None:
        w = self.weights
        lora_sgmv_group_cpu(y, x, plan, w.layer_pools[layer], self._mirror().blocks[layer][group], w.out_cols[group])

    def linear(self, plan: torch.Tensor, layer: int, group: str, proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """One op where proj's GEMM route has a fused twin (PackedLinear `fused_lora`), else proj(x) and `apply`."""
        if isinstance(proj, PackedLinear):
            w = self.weights
            block = self._mirror().blocks[layer][group]
            y = proj.fused_lora(x, plan, w.layer_pools[layer], block, w.out_cols[group])
            if y is not None:
                return y
        return super().linear(plan, layer, group, proj, x)


@dataclass(slots=True)
class Segments:
    """The torch route's per-segment plan: the step's segments as Python lists."""

    starts: list[int]
    slots: list[int]


class TorchLora(LoraRoute["StackPlan | Segments"]):
    """A decoding step's adapters at once over a stacked copy (`StackPlan`, engine/lora/stacks.py says when);
    otherwise segment by segment from the Python tables (`Segments`)."""

    kernel = Kernel.TORCH

    def __init__(self, weights: PoolWeights, max_stack_bytes: int = STACK_MAX_BYTES) -> None:
        super().__init__(weights)
        self.stacks = LoraStacks(weights, max_stack_bytes)

    def plan(self, seg_starts: list[int], seg_slots: list[int], null_slot: int) -> StackPlan | Segments:
        return self.stacks.plan(seg_starts, seg_slots, null_slot) or Segments(seg_starts, seg_slots)

    def apply(self, plan: StackPlan | Segments, layer: int, group: str, y: torch.Tensor, x: torch.Tensor) -> None:
        w = self.weights
        if isinstance(plan, StackPlan):
            stack = plan.stack
            a, b = stack.a[layer][group], stack.b[layer][group]
            lora_bmm_group(y, x, plan.gather, plan.mask, a, b, stack.h_cols[group], w.out_cols[group])
            return
        names = GROUPS[group]
        lora_sgmv_group(
            y,
            x,
            plan.starts,
            plan.slots,
            w.layer_pools[layer],
            w.tables.a_offsets[layer][group],
            [w.tables.ranks[layer][m] for m in names],
            [w.tables.b_offsets[layer][m] for m in names],
            w.out_cols[group],
        )


@dataclass(slots=True)
class TritonPlan:
    """The step's row tiles (loragate_kernels/triton/sgmv.py SgmvPlan) and each group's rank bound (None: the
    largest loaded, `PoolWeights.max_rank`; a captured CUDA graph's is larger, engine/worker/cuda_graphs.py)."""

    tiles: Any  # loragate_kernels.triton.sgmv.SgmvPlan (imported with triton, on first use)
    max_rank: dict[str, int] | None = None


class TritonLora(LoraRoute[TritonPlan]):
    kernel = Kernel.TRITON
    mirror = True

    def plan(self, seg_starts: list[int], seg_slots: list[int], null_slot: int) -> TritonPlan:
        from loragate_kernels.triton.sgmv import plan_segments

        device = self.weights.layer_pools[0].device
        return TritonPlan(plan_segments(seg_starts, seg_slots, device, skip_slot=null_slot))

    def apply(self, plan: TritonPlan, layer: int, group: str, y: torch.Tensor, x: torch.Tensor) -> None:
        from loragate_kernels.triton.sgmv import lora_sgmv_group_triton

        w, mirror = self.weights, self._mirror()
        ranks = w.max_rank if plan.max_rank is None else plan.max_rank
        lora_sgmv_group_triton(
            y,
            x,
            plan.tiles,
            w.layer_pools[layer],
            mirror.tables[layer][group],
            mirror.out_cols[group],
            mirror.n_tiles[group],
            ranks[group],
        )


ROUTES: dict[Kernel, type[LoraRoute[Any]]] = {Kernel.CPP: CppLora, Kernel.TORCH: TorchLora, Kernel.TRITON: TritonLora}
