"""The CPU path's batched LoRA: a decoding step's adapters stacked once, then one batched matmul per module.

Per segment and module (`loragate_kernels.reference.lora_sgmv_group`), a step of 32 decodes over 8 adapters is ~2,600
tiny matmuls on SmolLM2 (30 layers x 4 groups x 8 segments x a shrink and 1-3 expands), and their dispatch, not
their FLOPs, cost ~60 ms a step against ~95 ms for the base model's whole step (bench/step_profile.py --lora).
When a step's rows are few per adapter (decoding), `lora_bmm_group` computes the same sums for all adapters at
once: ~26 ops a layer. It reads each adapter's weights as one [U, rank, features] block per layer and module,
which the page pool cannot offer as a view (slots sit at arbitrary pages, ranks differ), so `LoraStacks` copies
the step's adapters into that layout, zero-padded to the largest rank of the step per module, in fp32 (products
and sums in fp32 also for a bf16 model), and keeps it while the step's adapter set and the tier's contents stay
the same (a decode batch keeps its adapters for many steps; when requests finish, the stack of the larger set
serves the smaller one while it is at most twice its size). A step with long segments (prefill) or whose stack
would pass `max_bytes` keeps the per-segment path.

The pool stays the one home of adapter weights (S-LoRA): a stack is a derived copy of at most `max_bytes`,
dropped when the step's set changes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.lora.peft_config import GROUPS
from engine.lora.tables import PoolWeights

# Segments up to this many rows per adapter take the stacked path (decodes; a short chunk); longer ones are
# cheaper per segment, where a matmul's FLOPs outweigh its dispatch.
MAX_ROWS_PER_ADAPTER = 16


@dataclass(slots=True)
class StackPlan:
    """One step's row layout for `lora_bmm_group`: adapter u's rows are gather[u * n : (u + 1) * n]."""

    gather: torch.Tensor | slice  # [U * n] int64, or the slice they span when they are consecutive rows
    mask: torch.Tensor | None  # [U, n, 1] fp32: 0 on padding rows; None without padding
    stack: StackedWeights


@dataclass(slots=True)
class StackedWeights:
    """The step's adapters' weights per layer: a [U, R, in] A stack per group, a [U, R_m, out_m] B per module."""

    key: tuple[tuple[int, ...], int]  # (the adapters' slots in stack order, the tier's generation)
    a: list[dict[str, torch.Tensor]]  # [layer][group]
    b: list[dict[str, list[torch.Tensor | None]]]  # [layer][group][module]
    h_cols: dict[str, list[int]]  # [group]: each module's columns in the group's h (the same in every layer)
    nbytes: int


class LoraStacks:
    """Builds `StackPlan`s and keeps the last step's `StackedWeights` (see the module docstring)."""

    def __init__(self, weights: PoolWeights, max_bytes: int) -> None:
        self.weights = weights
        self.max_bytes = max_bytes
        self.current: StackedWeights | None = None
        self.refused: tuple[tuple[int, ...], int] | None = None  # the last adapter set over max_bytes
        self.builds = 0  # how many times a stack was built (tests; a decode run builds one)

    def plan(self, seg_starts: list[int], seg_slots: list[int], null_slot: int) -> StackPlan | None:
        """The stacked layout of a step's segments, or None where the per-segment path is the better one."""
        rows: dict[int, list[int]] = {}
        for slot, lo, hi in zip(seg_slots, seg_starts, seg_starts[1:], strict=False):
            if slot != null_slot and hi > lo:
                rows.setdefault(slot, []).extend(range(lo, hi))
        if not rows:
            return None
        n = max(map(len, rows.values()))
        if n > MAX_ROWS_PER_ADAPTER:
            return None
        stack = self._stack(tuple(sorted(rows)))
        if stack is None:
            return None
        # The stack's adapters, in its order: the step's, or a superset kept from earlier steps, whose extra
        # adapters get padding rows only.
        filler = next(iter(rows.values()))[0]
        gather: list[int] = []
        counts: list[int] = []
        for slot in stack.key[0]:
            own = rows.get(slot, [])
            gather += own + [own[0] if own else filler] * (n - len(own))
            counts.append(len(own))
        if gather == list(range(gather[0], gather[0] + len(gather))):  # a decode batch grouped by adapter
            return StackPlan(slice(gather[0], gather[0] + len(gather)), None, stack)
        device = self.weights.layer_pools[0].device
        mask = None
        if min(counts) < n:
            mask = torch.tensor([[[1.0]] * c + [[0.0]] * (n - c) for c in counts], device=device)
        return StackPlan(torch.tensor(gather, dtype=torch.int64, device=device), mask, stack)

    def _stack(self, slots: tuple[int, ...]) -> StackedWeights | None:
        key = (slots, self.weights.generation)
        current = self.current
        if current is not None and current.key[1] == key[1]:
            kept = current.key[0]
            # the same adapters, or a few more (a request finished): reused rather than copied again
            if kept == slots or (set(slots) <= set(kept) and len(kept) <= 2 * len(slots)):
                return current
        if key == self.refused:  # over the bound: not sized again every step
            return None
        self.current = None  # the old stack goes before the new one is built
        tables = self.weights.tables
        layers = len(self.weights.layer_pools)
        h_cols: dict[str, list[int]] = {}
        for group, names in GROUPS.items():  # per module, the largest rank of these adapters in any layer
            bounds = [0]
            for module in names:
                bounds.append(bounds[-1] + max(tables.ranks[i][module][s] for i in range(layers) for s in slots))
            h_cols[group] = bounds
        out_cols = self.weights.out_cols
        d_in = self.weights.in_features
        per_layer = sum(
            len(slots)
            * (
                cols[-1] * d_in[g]
                + sum((cols[m + 1] - cols[m]) * (out_cols[g][m + 1] - out_cols[g][m]) for m in range(len(cols) - 1))
            )
            for g, cols in h_cols.items()
        )
        nbytes = per_layer * layers * 4
        if nbytes > self.max_bytes:
            self.refused = key
            return None
        a_all, b_all = [], []
        zeros = functools.partial(torch.zeros, device=self.weights.layer_pools[0].device)
        for i, pool in enumerate(self.weights.layer_pools):
            a_layer, b_layer = {}, {}
            for group, names in GROUPS.items():
                cols, outs = h_cols[group], out_cols[group]
                a = zeros(len(slots), cols[-1], d_in[group])
                bs: list[torch.Tensor | None] = [
                    zeros(len(slots), cols[m + 1] - cols[m], outs[m + 1] - outs[m]) if cols[m + 1] > cols[m] else None
                    for m in range(len(names))
                ]
                for u, slot in enumerate(slots):
                    offset, d = tables.a_offsets[i][group][slot], d_in[group]
                    for m, module in enumerate(names):
                        r = tables.ranks[i][module][slot]
                        if not r:
                            continue
                        a[u, cols[m] : cols[m] + r] = pool[offset : offset + r * d].view(r, d)
                        offset += r * d
                        out = outs[m + 1] - outs[m]
                        b_off = tables.b_offsets[i][module][slot]
                        b = bs[m]
                        assert b is not None
                        b[u, :r] = pool[b_off : b_off + r * out].view(r, out)
                a_layer[group], b_layer[group] = a, bs
            a_all.append(a_layer)
            b_all.append(b_layer)
        self.current = StackedWeights(key, a_all, b_all, h_cols, nbytes)
        self.builds += 1
        return self.current
