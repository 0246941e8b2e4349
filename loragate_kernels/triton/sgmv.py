"""Segmented-gather LoRA (SGMV, Punica's idea) as Triton kernels that read the unified page pool directly.

One launch serves every segment of a step for a group of modules sharing their input (q/k/v, gate/up, or
one module alone), with heterogeneous ranks and no padding of stored weights: each adapter's A and
scale-folded B sit in the pool exactly where engine/lora/device_tier.py wrote them, found through
per-slot tables (a device mirror kept by the tier), and only the in-register tile is rounded up to a
block. Two kernels, as in the torch twin (loragate_kernels/reference.py `lora_sgmv_group`, the oracle):

    shrink:  h[rows, :R_k]            = x[rows] @ A_stack_k.T          (fp32 accumulator buffer)
    expand:  y[rows, out_cols[m] + j] += h[rows, c_mk : c_mk + r_mk] @ B_mk.T   for every module m (B_mk.T is
             what the pool stores: [r, out_m] row-major)

Tiles cover only segment rows, so rows outside every segment and rank-0 modules are never touched. The
per-step metadata (`SgmvPlan`: which segment and first row each row tile has) is built once per step and
shared by all layers and groups.

Dtypes: pool, x and y share a dtype (fp32, fp16 or bf16); products accumulate in fp32; fp32 dots run in
IEEE precision (Triton would default them to tf32). Kernels run compiled for CUDA tensors and under Triton's
interpreter for CPU ones (loragate_kernels/triton/jit.py); interpreted, dot operands are cast to fp32 first: the
interpreter multiplies bf16 dots' raw bits (triton issue 11584).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loragate_kernels.triton.jit import cuda_device, device_jit, interpreted

BLOCK_M = 16  # rows per tile (a decode segment of one row still takes a whole tile)
BLOCK_N = 32  # output columns (expand) or rank rows (shrink) per tile
BLOCK_K = 64  # reduction chunk (shrink: input features; expand: rank)
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@dataclass(frozen=True, slots=True)
class SgmvPlan:
    """A step's row tiles, shared by every layer and group: tile t covers rows
    [tile_start[t], min(tile_start[t] + BLOCK_M, tile_end[t])) of segment tile_seg[t], whose slot is
    tile_slot[t]. Built once per step (`plan_segments`)."""

    tile_slot: torch.Tensor  # [num_tiles] int32
    tile_start: torch.Tensor  # [num_tiles] int32
    tile_end: torch.Tensor  # [num_tiles] int32: the segment's end row
    num_tiles: int


def plan_segments(
    seg_starts: Sequence[int],
    seg_slots: Sequence[int],
    device: torch.device,
    block_m: int = BLOCK_M,
    skip_slot: int | None = None,
) -> SgmvPlan:
    """Split every non-empty segment into row tiles of `block_m` (segments of `skip_slot`, rows without an
    adapter, get none)."""
    slots, starts, ends = segment_tiles(seg_starts, seg_slots, block_m, skip_slot)
    table = torch.tensor([slots, starts, ends], dtype=torch.int32).to(device, non_blocking=True)
    return SgmvPlan(table[0], table[1], table[2], len(slots))


def segment_tiles(
    seg_starts: Sequence[int], seg_slots: Sequence[int], block_m: int = BLOCK_M, skip_slot: int | None = None
) -> tuple[list[int], list[int], list[int]]:
    """The row tiles of `plan_segments` as host lists: (slot, first row, segment end) of each tile. At most one
    tile per row, so a batch of B rows has at most B tiles (what a captured graph sizes its tables by)."""
    slots: list[int] = []
    starts: list[int] = []
    ends: list[int] = []
    for k, lo, hi in zip(seg_slots, seg_starts, seg_starts[1:], strict=False):
        if k == skip_slot:
            continue
        for row in range(lo, hi, block_m):
            slots.append(k)
            starts.append(row)
            ends.append(hi)
    return slots, starts, ends


@dataclass(frozen=True, slots=True)
class GroupTables:
    """Where a group's weights sit for every slot, on the device (engine/lora/device_tier.py updates the
    column of a slot when an adapter is loaded or evicted).

    a_offsets [num_slots]: the stacked A; ranks [M, num_slots]; b_offsets [M, num_slots]; h_cols [M, num_slots]:
    where module m's rank block starts in h (the sum of the ranks before it); rank_total [num_slots]. Integer
    tensors (the tier's are int64 views of one table, which the CPU's C++ op requires; the kernels take int32 too).
    """

    a_offsets: torch.Tensor
    ranks: torch.Tensor
    b_offsets: torch.Tensor
    h_cols: torch.Tensor
    rank_total: torch.Tensor


@device_jit
def _shrink_kernel(
    x_ptr,
    pool_ptr,
    h_ptr,
    tile_slot,
    tile_start,
    tile_end,
    a_offsets,
    rank_total,
    in_features,
    stride_x,
    stride_h,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CAST_FP32: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    slot = tl.load(tile_slot + tile)
    big_r = tl.load(rank_total + slot)
    if n0 >= big_r:  # past this slot's rank (or a rank-0 slot): nothing to write
        return
    row0 = tl.load(tile_start + tile)
    row_end = tl.load(tile_end + tile)
    a_base = tl.load(a_offsets + slot)  # int64
    rows = row0 + tl.arange(0, BLOCK_M)
    ns = n0 + tl.arange(0, BLOCK_N)
    row_ok = rows < row_end
    n_ok = ns < big_r
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < in_features
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        a = tl.load(
            pool_ptr + a_base + ns[:, None].to(tl.int64) * in_features + ks[None, :],
            mask=n_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # A rows of this slot only
        if CAST_FP32:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        if IEEE:
            acc += tl.dot(x, tl.trans(a), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(a))
    tl.store(h_ptr + rows[:, None].to(tl.int64) * stride_h + ns[None, :], acc, mask=row_ok[:, None] & n_ok[None, :])


@device_jit
def _expand_kernel(
    h_ptr,
    pool_ptr,
    y_ptr,
    tile_slot,
    tile_start,
    tile_end,
    ranks,
    b_offsets,
    h_cols,
    n_tile_module,
    n_tile_col,
    out_cols,
    num_slots,
    stride_h,
    stride_y,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CAST_FP32: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    n_tile = tl.program_id(1)
    module = tl.load(n_tile_module + n_tile)
    slot = tl.load(tile_slot + tile)
    r = tl.load(ranks + module * num_slots + slot)
    if r == 0:  # this slot does not target the module: its columns stay untouched
        return
    col0 = tl.load(n_tile_col + n_tile)  # first column of this tile, within the module
    out_lo = tl.load(out_cols + module)
    out_m = tl.load(out_cols + module + 1) - out_lo
    b_base = tl.load(b_offsets + module * num_slots + slot)  # int64
    h_col = tl.load(h_cols + module * num_slots + slot)
    row0 = tl.load(tile_start + tile)
    row_end = tl.load(tile_end + tile)
    rows = row0 + tl.arange(0, BLOCK_M)
    js = col0 + tl.arange(0, BLOCK_N)
    row_ok = rows < row_end
    j_ok = js < out_m
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, r, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < r
        h = tl.load(
            h_ptr + rows[:, None].to(tl.int64) * stride_h + h_col + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            pool_ptr + b_base + ks[:, None].to(tl.int64) * out_m + js[None, :],
            mask=k_ok[:, None] & j_ok[None, :],
            other=0.0,
        )  # B.T [r, out_m] of this slot only
        if IEEE:  # fp32 weights: an fp32 product in IEEE precision
            acc += tl.dot(h, b, input_precision="ieee")
        else:  # bf16/fp16 weights: h rounded to their dtype, on the tensor cores, accumulated in fp32
            h = h.to(b.dtype)
            if CAST_FP32:
                h = h.to(tl.float32)
                b = b.to(tl.float32)
            acc += tl.dot(h, b)
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_y + out_lo + js[None, :]
    mask = row_ok[:, None] & j_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


def column_tiles(
    out_cols: Sequence[int], device: torch.device, block_n: int = BLOCK_N
) -> tuple[torch.Tensor, torch.Tensor]:
    """(module, first column within the module) of every output tile of a group: static per model."""
    modules, cols = [], []
    for m, (lo, hi) in enumerate(zip(out_cols, out_cols[1:], strict=False)):
        for col in range(0, hi - lo, block_n):
            modules.append(m)
            cols.append(col)
    table = torch.tensor([modules, cols], dtype=torch.int32, device=device)
    return table[0], table[1]


def lora_sgmv_group_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    plan: SgmvPlan,
    pool: torch.Tensor,
    tables: GroupTables,
    out_cols: torch.Tensor,
    n_tiles: tuple[torch.Tensor, torch.Tensor],
    max_rank: int,
) -> None:
    """Add each segment's LoRA deltas for one module group to its fused output `y`, in place: the same
    result as loragate_kernels/reference.py `lora_sgmv_group`, with the index tables as device tensors.

    Semantics:
        for t in range(plan.num_tiles):                        # row tiles of the segments, adapter rows only
            k = plan.tile_slot[t]; rows = plan.tile_start[t] : min(+BLOCK_M, plan.tile_end[t])
            R = tables.rank_total[k]
            A = pool[tables.a_offsets[k] : + R * in_features].view(R, in_features)
            h[rows, :R] = x[rows].float() @ A.float().T       # shrink, fp32
            for m in modules:
                r = tables.ranks[m, k]; c = tables.h_cols[m, k]
                if r == 0: continue
                B_t = pool[tables.b_offsets[m, k] : + r * out_m].view(r, out_m)   # B stored transposed
                y[rows, out_cols[m] : out_cols[m + 1]] += (h[rows, c : c + r] @ B_t.float()).to(y.dtype)

    Shapes:
        y:         [T, out_cols[-1]]   row stride arbitrary, columns contiguous
        x:         [T, in_features]    row stride arbitrary, columns contiguous
        plan:      SgmvPlan            the step's row tiles (plan_segments), shared by all layers
        pool:      [N]                 contiguous, same dtype as x and y
        tables:    GroupTables         a_offsets [S] int64, ranks/h_cols [M, S] int32, b_offsets [M, S]
                                       int64, rank_total [S] int32 (the device tier's mirror)
        out_cols:  [M + 1] int32       the modules' column boundaries in y
        n_tiles:   column_tiles(...)   (module, first column) of every output tile
        max_rank:  int                 at least every slot's rank_total (sizes the fp32 buffer h)
    """
    assert y.dtype == x.dtype == pool.dtype and pool.dim() == 1 and pool.is_contiguous(), (
        f"dtypes and layout: y {y.dtype}, x {x.dtype}, pool {pool.dtype} (contiguous 1-D)"
    )
    assert x.stride(1) == 1 and y.stride(1) == 1, "x and y need contiguous columns"
    assert min(BLOCK_M, BLOCK_N, BLOCK_K) >= 16, "tl.dot needs blocks of at least 16 on a GPU"
    if plan.num_tiles == 0 or max_rank == 0:
        return
    h = torch.empty((x.shape[0], max_rank), dtype=torch.float32, device=x.device)
    cast = interpreted(x.device)  # the interpreter's bf16 dot is wrong: it gets fp32 operands
    ieee = x.dtype == torch.float32  # fp32 dots in IEEE precision, not tf32
    grid = (plan.num_tiles, triton.cdiv(max_rank, BLOCK_N))
    with cuda_device(x.device):  # Triton launches on the current CUDA device
        _shrink_kernel.on(x.device)[grid](
            x,
            pool,
            h,
            plan.tile_slot,
            plan.tile_start,
            plan.tile_end,
            tables.a_offsets,
            tables.rank_total,
            x.shape[1],
            x.stride(0),
            h.stride(0),
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
            CAST_FP32=cast,
            IEEE=ieee,
        )
        n_tile_module, n_tile_col = n_tiles
        grid = (plan.num_tiles, n_tile_module.numel())
        _expand_kernel.on(x.device)[grid](
            h,
            pool,
            y,
            plan.tile_slot,
            plan.tile_start,
            plan.tile_end,
            tables.ranks,
            tables.b_offsets,
            tables.h_cols,
            n_tile_module,
            n_tile_col,
            out_cols,
            tables.ranks.shape[1],
            h.stride(0),
            y.stride(0),
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
            CAST_FP32=cast,
            IEEE=ieee,
        )
