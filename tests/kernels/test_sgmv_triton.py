"""The Triton SGMV kernels (loragate_kernels/triton/sgmv.py) against their torch twin (loragate_kernels/reference.py
`lora_sgmv_group`), itself checked against a per-row float64 oracle written here.

Without a GPU the kernels run under Triton's interpreter on CPU tensors (loragate_kernels/triton/jit.py picks it by
the tensors' device); with one, the same tests run compiled on CUDA tensors. Each case mixes ranks
{1, 4, 8, 16, 64} in one batch, a group of three modules of different widths (q/k/v-like) where some slots
do not target every module, a rank-0 slot, T = 1, a segment longer than one row tile, a slot used by two
segments, an empty segment and rows in no segment (all bit-identical afterwards), A and B at unaligned,
shuffled offsets, and NaN in every pool element no adapter owns (a kernel reading outside its slot's
weights turns the result into NaN).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from loragate_kernels.reference import lora_sgmv_group
from loragate_kernels.triton.sgmv import BLOCK_M, GroupTables, column_tiles, lora_sgmv_group_triton, plan_segments

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}  # relative to the largest |delta|


@dataclass
class GroupCase:
    y_wide: torch.Tensor  # [T, out_total + 5]; y is columns 2 : 2 + out_total
    x: torch.Tensor
    seg_starts: list[int]
    seg_slots: list[int]
    pool: torch.Tensor
    a_offsets: list[int]
    ranks: list[list[int]]  # [module][slot]
    b_offsets: list[list[int]]
    out_cols: list[int]

    @property
    def y(self) -> torch.Tensor:
        return self.y_wide[:, 2 : 2 + self.out_cols[-1]]


def make_group_case(d_in: int, outs: list[int], layout: str, dtype: torch.dtype, seed: int) -> GroupCase:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    base_ranks = [1, 4, 8, 16, 64]
    slots = len(base_ranks) + 1  # the last slot targets nothing (rank 0 everywhere)
    ranks = [[0] * slots for _ in outs]
    for k, r in enumerate(base_ranks):
        for m in range(len(outs)):
            # Slot 2 skips the middle module; slot 3 has a smaller rank on the last one (rank_pattern).
            ranks[m][k] = 0 if (k == 2 and m == 1) else max(1, r // 2) if (k == 3 and m == len(outs) - 1) else r
    blocks = [(k, "a", sum(ranks[m][k] for m in range(len(outs))) * d_in) for k in range(slots)]
    blocks += [(k, m, outs[m] * ranks[m][k]) for k in range(slots) for m in range(len(outs))]
    rng.shuffle(blocks)
    a_offsets, b_offsets = [0] * slots, [[0] * slots for _ in outs]
    cursor = rng.randrange(1, 9)
    for k, which, size in blocks:
        if which == "a":
            a_offsets[k] = cursor
        else:
            b_offsets[which][k] = cursor
        cursor += size + rng.randrange(1, 9)
    pool = torch.full((cursor + 16,), float("nan"), dtype=torch.float32)
    for k, which, size in blocks:
        start = a_offsets[k] if which == "a" else b_offsets[which][k]
        pool[start : start + size] = torch.randn(size, generator=g) * 0.2
    pool = pool.to(dtype)
    # Segments (slot per segment): T = 1 is the one-row case.
    plans = {
        "mixed": ([3, 0, 1, 2 * BLOCK_M + 3, 2, 1, 4], [0, 1, 2, 3, 4, 5, 0]),  # empty, long, rank-0, repeated
        "one-row": ([1], [4]),
        "decode": ([1] * 7, [4, 3, 2, 1, 0, 4, 5]),
    }
    lens, seg_slots = plans[layout]
    first = 0 if layout == "one-row" else 2  # rows before the first segment have no adapter
    seg_starts = [first]
    for n in lens:
        seg_starts.append(seg_starts[-1] + n)
    t = seg_starts[-1] + (0 if layout == "one-row" else 3)
    x = torch.randn(t, d_in, generator=g).to(dtype)
    out_cols = [0]
    for out in outs:
        out_cols.append(out_cols[-1] + out)
    y_wide = torch.randn(t, out_cols[-1] + 5, generator=g).to(dtype)
    return GroupCase(y_wide, x, seg_starts, seg_slots, pool, a_offsets, ranks, b_offsets, out_cols)


def oracle(case: GroupCase) -> tuple[torch.Tensor, torch.Tensor]:
    """(delta [T, out_total] in float64, touched [T, out_total] bool), row by row."""
    t, d_in = case.x.shape
    delta = torch.zeros(t, case.out_cols[-1], dtype=torch.float64)
    touched = torch.zeros(t, case.out_cols[-1], dtype=torch.bool)
    pool = case.pool.double()
    for s, k in enumerate(case.seg_slots):
        for row in range(case.seg_starts[s], case.seg_starts[s + 1]):
            c, offset = 0, case.a_offsets[k]
            module_ranks = [case.ranks[m][k] for m in range(len(case.ranks))]
            a_all = pool[offset : offset + sum(module_ranks) * d_in].reshape(-1, d_in)
            for m, r in enumerate(module_ranks):
                if r == 0:
                    continue
                lo, hi = case.out_cols[m], case.out_cols[m + 1]
                b_t = pool[case.b_offsets[m][k] : case.b_offsets[m][k] + r * (hi - lo)].reshape(r, hi - lo)
                delta[row, lo:hi] = (a_all[c : c + r] @ case.x[row].double()) @ b_t  # the pool stores B.T
                touched[row, lo:hi] = True
                c += r
    return delta, touched


def assert_update(case: GroupCase, before: torch.Tensor, delta: torch.Tensor, touched: torch.Tensor) -> None:
    y_after, y_before = case.y.cpu().double(), before[:, 2 : 2 + case.out_cols[-1]].double()
    tol = TOLERANCE[case.x.dtype] * max(delta.abs().max().item(), 1.0)
    torch.testing.assert_close(y_after[touched], y_before[touched] + delta[touched], rtol=0, atol=tol)
    assert torch.equal(case.y.cpu()[~touched], before[:, 2 : 2 + case.out_cols[-1]][~touched])
    assert torch.equal(case.y_wide.cpu()[:, :2], before[:, :2])
    assert torch.equal(case.y_wide.cpu()[:, 2 + case.out_cols[-1] :], before[:, 2 + case.out_cols[-1] :])


def run_twin(case: GroupCase) -> None:
    """The torch twin (loragate_kernels/reference.py `lora_sgmv_group`) on the case, in place."""
    lora_sgmv_group(
        case.y,
        case.x,
        case.seg_starts,
        case.seg_slots,
        case.pool,
        case.a_offsets,
        case.ranks,
        case.b_offsets,
        case.out_cols,
    )


def run_triton(case: GroupCase) -> None:
    """Move the case to the device and run the Triton kernels with tables built as the tier builds them."""
    for name in ("y_wide", "x", "pool"):
        setattr(case, name, getattr(case, name).to(DEVICE))
    ranks = torch.tensor(case.ranks, dtype=torch.int32)
    h_cols = torch.cumsum(ranks, dim=0, dtype=torch.int32) - ranks
    tables = GroupTables(
        torch.tensor(case.a_offsets), ranks, torch.tensor(case.b_offsets), h_cols, ranks.sum(0, dtype=torch.int32)
    )
    tables = GroupTables(
        *(t.to(DEVICE) for t in (tables.a_offsets, tables.ranks, tables.b_offsets, tables.h_cols, tables.rank_total))
    )
    plan = plan_segments(case.seg_starts, case.seg_slots, DEVICE)
    out_cols = torch.tensor(case.out_cols, dtype=torch.int32, device=DEVICE)
    lora_sgmv_group_triton(
        case.y, case.x, plan, case.pool, tables, out_cols, column_tiles(case.out_cols, DEVICE), int(ranks.sum(0).max())
    )


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LAYOUTS = ["mixed", "one-row", "decode"]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_group_kernels_match_the_oracle(dtype: torch.dtype, layout: str) -> None:
    seed = 100 * LAYOUTS.index(layout) + DTYPES.index(dtype)  # fixed: the same case on every run
    case = make_group_case(48, [40, 24, 24], layout, dtype, seed=seed)
    delta, touched = oracle(case)
    before = case.y_wide.clone()
    run_triton(case)
    assert not torch.isnan(case.y).any()  # no element of the pool outside a slot's weights was read
    assert_update(case, before, delta, touched)


@pytest.mark.parametrize("outs", [[40, 24, 24], [72], [56, 56]], ids=["qkv", "one-module", "gate-up"])
def test_triton_equals_the_torch_twin(outs: list[int]) -> None:
    twin = make_group_case(32, outs, "mixed", torch.float32, seed=7)
    triton_case = make_group_case(32, outs, "mixed", torch.float32, seed=7)
    run_twin(twin)
    run_triton(triton_case)
    torch.testing.assert_close(triton_case.y.cpu(), twin.y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["mixed", "decode"])
def test_the_torch_twin_matches_the_oracle(layout: str) -> None:
    case = make_group_case(48, [40, 24, 24], layout, torch.float32, seed=3)
    delta, touched = oracle(case)
    before = case.y_wide.clone()
    run_twin(case)
    assert not torch.isnan(case.y).any()
    assert_update(case, before, delta, touched)
