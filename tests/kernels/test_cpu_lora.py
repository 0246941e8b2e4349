"""The CPU's C++ LoRA op (loragate_kernels/cpu/lora.cpp) against the per-row float64 oracle and the torch twin
(loragate_kernels/reference.py `lora_sgmv_group`), on the cases tests/kernels/test_sgmv_triton.py builds: mixed ranks
{1, 4, 8, 16, 64}, a module some slots skip, a rank-0 slot, empty and repeated segments, rows in no segment,
unaligned shuffled offsets and NaN in every pool element no adapter owns (reading outside a slot's weights
turns the result into NaN); y a column slice of a wider tensor. Also: the op refuses tables that point outside
the pool, and each GEMM's fused twin equals the GEMM then the op. (Where the ops cannot be built the torch route
serves: tests/kernels/test_backends.py.)
"""

from __future__ import annotations

import pytest
import torch
from test_sgmv_triton import DTYPES, LAYOUTS, GroupCase, assert_update, make_group_case, oracle, run_twin

from loragate_kernels.cpu import ops as cpu_ops
from loragate_kernels.triton.sgmv import GroupTables

from built_ops import require_cpu_ops


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    require_cpu_ops()


def tables_of(case: GroupCase) -> GroupTables:
    """The tables as the device tier's mirror holds them: int64, [modules, slots]."""
    ranks = torch.tensor(case.ranks, dtype=torch.int64)
    return GroupTables(
        torch.tensor(case.a_offsets, dtype=torch.int64),
        ranks,
        torch.tensor(case.b_offsets, dtype=torch.int64),
        torch.cumsum(ranks, dim=0) - ranks,
        ranks.sum(0),
    )


def segments_of(case: GroupCase) -> torch.Tensor:
    return torch.tensor(case.seg_starts + case.seg_slots, dtype=torch.int64)


def run_op(case: GroupCase, tables: GroupTables | None = None) -> None:
    """The op as the engine calls it: the tables packed as the device tier's block (three module rows, the most a
    group has, of which a group of fewer uses the first)."""
    block = cpu_ops.pack_tables(tables or tables_of(case), modules=3)
    cpu_ops.lora_sgmv_group_cpu(case.y, case.x, segments_of(case), case.pool, block, case.out_cols)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("outs", [[40, 24, 24], [130, 64, 7]], ids=["narrow", "wide"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_op_matches_the_oracle(layout: str, dtype: torch.dtype, outs: list[int], threads: int) -> None:
    # "wide" has modules over 64 columns (the op's vectorized column blocks) and one of 7 (a partial block)
    seed = 10 * LAYOUTS.index(layout) + DTYPES.index(dtype)
    case = make_group_case(48, outs, layout, dtype, seed=seed)
    delta, touched = oracle(case)
    before = case.y_wide.clone()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        run_op(case)
    finally:
        torch.set_num_threads(previous)
    assert not torch.isnan(case.y).any()  # no pool element outside a slot's weights was read
    assert_update(case, before, delta, touched)


@pytest.mark.parametrize("outs", [[40, 24, 24], [72], [56, 56]], ids=["qkv", "one-module", "gate-up"])
def test_the_op_equals_the_torch_twin_in_fp32(outs: list[int]) -> None:
    twin = make_group_case(32, outs, "mixed", torch.float32, seed=7)
    ours = make_group_case(32, outs, "mixed", torch.float32, seed=7)
    run_twin(twin)
    run_op(ours)
    torch.testing.assert_close(ours.y, twin.y, rtol=1e-5, atol=1e-5)


def test_bf16_rounds_once_from_fp32_sums() -> None:
    """bf16 weights and activations: the op's result is the fp32 computation on the same values, rounded once."""
    ours = make_group_case(48, [130, 64, 7], "mixed", torch.bfloat16, seed=5)
    wide = make_group_case(48, [130, 64, 7], "mixed", torch.bfloat16, seed=5)
    for name in ("y_wide", "x", "pool"):
        setattr(wide, name, getattr(wide, name).float())
    run_op(ours)
    run_op(wide)
    # at most one bf16 rounding of the fp32 result (half an ulp, 2^-8 relative) plus fp32 summation order
    torch.testing.assert_close(ours.y.float(), wide.y, rtol=2**-8, atol=1e-6)


def test_the_op_refuses_tables_outside_the_pool() -> None:
    case = make_group_case(48, [40, 24, 24], "mixed", torch.float32, seed=1)
    good = tables_of(case)
    past_end = case.pool.numel() - 10
    bad_a = GroupTables(
        good.a_offsets.clone().fill_(past_end), good.ranks, good.b_offsets, good.h_cols, good.rank_total
    )
    bad_b = GroupTables(
        good.a_offsets, good.ranks, good.b_offsets.clone().fill_(past_end), good.h_cols, good.rank_total
    )
    negative = GroupTables(good.a_offsets.clone().fill_(-1), good.ranks, good.b_offsets, good.h_cols, good.rank_total)
    before = case.y.clone()
    for tables, message in ((bad_a, "A overruns"), (bad_b, "B overruns"), (negative, "A overruns")):
        with pytest.raises(RuntimeError, match=message):
            run_op(case, tables)
    block = cpu_ops.pack_tables(good)
    segments = segments_of(case)
    num_segs = len(case.seg_slots)
    bad_slot = segments.clone()
    bad_slot[num_segs + 1 :] += 100
    backwards = segments.clone()
    backwards[: num_segs + 1] = backwards[: num_segs + 1].flip(0)

    args = {"y": case.y, "x": case.x, "segments": segments, "pool": case.pool, "block": block}
    for changes, message in (
        ({"segments": bad_slot}, "names slot"),
        ({"segments": backwards}, "nondecreasing"),
        ({"segments": segments[:-1]}, "2 S \\+ 1"),
        ({"segments": segments.int()}, "int64"),
        ({"block": block[:-1]}, "block must be"),
        ({"block": cpu_ops.pack_tables(good)[:, :-1].contiguous()}, "names slot"),
        ({"x": case.x.double()}, "share a dtype"),
        ({"out_cols": [0, 40, 64]}, "out_cols"),
    ):
        with pytest.raises(RuntimeError, match=message):
            cpu_ops.lora_sgmv_group_cpu(**{**args, "out_cols": case.out_cols, **changes})  # type: ignore[arg-type]
    assert torch.equal(case.y, before)  # refused before writing anything


FUSED = [
    pytest.param(torch.float32, "skinny_linear", id="fp32-skinny"),
    pytest.param(torch.bfloat16, "amx_linear", id="bf16-tiles"),
    pytest.param(torch.float32, "panel_linear", id="fp32-panels"),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("dtype", "gemm"), FUSED)
def test_a_fused_gemm_equals_the_gemm_then_the_op(dtype: torch.dtype, gemm: str, layout: str) -> None:
    """skinny_linear_lora, amx_linear_lora and panel_linear_lora (one call for a projection and its LoRA group): the
    GEMM's output with the op applied, bit for bit; refused arguments raise."""
    if gemm == "amx_linear" and not (torch.ops.loragate_cpu.amx_ready() or torch.ops.loragate_cpu.dot_ready()):
        pytest.skip("this CPU or build has neither AMX tiles nor the AVX-512 bf16 dot instruction")
    if gemm == "panel_linear" and not torch.ops.loragate_cpu.panels_ready():
        pytest.skip("this CPU or build has no AVX-512")
    case = make_group_case(64, [64, 32, 32], layout, dtype, seed=3)
    g = torch.Generator().manual_seed(4)
    weight = (torch.randn(case.out_cols[-1], 64, generator=g) * 0.1).to(dtype)
    bias = (torch.randn(case.out_cols[-1], generator=g) * 0.1).to(dtype)
    pack = {"skinny_linear": torch.clone, "amx_linear": torch.ops.loragate_cpu.amx_pack_weight}
    packed = pack.get(gemm, torch.ops.loragate_cpu.panel_pack_weight)(weight)
    extra = (weight.shape[0],) if gemm == "panel_linear" else ()  # the panels' true width (they are zero-padded)
    block = cpu_ops.pack_tables(tables_of(case), modules=3)
    plain = getattr(torch.ops.loragate_cpu, gemm)
    fused = getattr(torch.ops.loragate_cpu, f"{gemm}_lora")
    expected = plain(case.x, packed, bias, *extra)
    cpu_ops.lora_sgmv_group_cpu(expected, case.x, segments_of(case), case.pool, block, case.out_cols)
    got = fused(case.x, packed, bias, *extra, segments_of(case), case.pool, block, case.out_cols)
    assert torch.equal(got, expected)
    bad = segments_of(case)
    bad[len(case.seg_slots) + 1 :] += 100
    with pytest.raises(RuntimeError, match="names slot"):
        fused(case.x, packed, bias, *extra, bad, case.pool, block, case.out_cols)
