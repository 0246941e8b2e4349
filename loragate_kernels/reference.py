"""Pure-torch twins of the batched-LoRA kernels: the CPU serving path and the oracle for the Triton ones.

A step's T token rows are grouped into contiguous segments, one adapter per segment (punica's SGMV);
rows in no segment have no adapter and are never touched. Adapter weights live in one layer's region
of the unified page pool (S-LoRA): a flat 1-D `pool` holding, per slot, A `[rank, in_features]` and B's
transpose `[rank, out_features]` row-major at element offsets, the LoRA scale already folded into B (B stored
transposed: an expand adds rows of it to each output row, contiguous reads for loragate_kernels/cpu/lora.cpp). Ranks
differ between slots; rank 0 means the slot does not target this module.

Every segment reads its weights through `as_strided` views of the pool, never a copy. At serving
sizes (a few rows per adapter, rank <= 64) the cost is per-op overhead, not FLOPs, so the loops do the
fewest torch calls per segment: two views, one `mm`, one in-place `addmm_`. This per-segment loop
measured faster than padding segments and ranks into one `bmm` (bench/lora_kernels.py).

Index arguments may be Python sequences or 1-D integer tensors; tensors are turned into Python ints
once per call. Pass lists to skip that conversion on the hot path.

`dora_scale_group` is the oracle of DoRA's rescale of a group's rows (engine/lora/dora.py, and the C++ op
loragate_kernels/cpu/lora.cpp `dora_scale_group`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

IntSeq = Sequence[int] | torch.Tensor


def _ints(values: IntSeq) -> Sequence[int]:
    return values.tolist() if isinstance(values, torch.Tensor) else values


def _segments(
    seg_starts: IntSeq, seg_slots: IntSeq, ranks: IntSeq, first: torch.Tensor, second: torch.Tensor
) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """(slot, rank, first's rows, second's rows) for every segment that has rows and a nonzero rank.

    The row blocks come from one `split` per tensor (cheaper than slicing per segment)."""
    starts, slots, rank_of = _ints(seg_starts), _ints(seg_slots), _ints(ranks)
    assert len(starts) == len(slots) + 1, "seg_starts must have one more entry than seg_slots"
    if not slots:
        return []
    sizes = [hi - lo for lo, hi in zip(starts, starts[1:], strict=False)]
    lo, hi = starts[0], starts[-1]
    assert lo >= 0 and min(sizes) >= 0 and hi <= first.shape[0], (
        f"seg_starts must be nondecreasing within [0, {first.shape[0]}]: {starts}"
    )
    firsts, seconds = first[lo:hi].split(sizes), second[lo:hi].split(sizes)
    return [(k, rank_of[k], firsts[s], seconds[s]) for s, k in enumerate(slots) if rank_of[k] and sizes[s]]


def _spans(seg_starts: IntSeq, seg_slots: IntSeq, num_rows: int) -> list[tuple[int, int, int]]:
    """(slot, first row, end row) of every segment that has rows."""
    starts, slots = _ints(seg_starts), _ints(seg_slots)
    assert len(starts) == len(slots) + 1, "seg_starts must have one more entry than seg_slots"
    assert all(0 <= lo <= hi <= num_rows for lo, hi in zip(starts, starts[1:], strict=False)), (
        f"seg_starts must be nondecreasing within [0, {num_rows}]: {starts}"
    )
    return [(k, lo, hi) for k, lo, hi in zip(slots, starts, starts[1:], strict=False) if hi > lo]


def _view(pool: torch.Tensor, offset: int, rows: int, cols: int) -> torch.Tensor:
    """The row-major matrix `[rows, cols]` at `offset` in `pool`, a view."""
    assert 0 <= offset and offset + rows * cols <= pool.numel(), (
        f"matrix [{rows}, {cols}] at offset {offset} overruns a pool of {pool.numel()} elements"
    )
    return pool.as_strided((rows, cols), (cols, 1), pool.storage_offset() + offset)


def _view_t(pool: torch.Tensor, offset: int, rows: int, cols: int) -> torch.Tensor:
    """The transpose `[cols, rows]` of the row-major matrix `[rows, cols]` at `offset` in `pool`, a view."""
    assert 0 <= offset and offset + rows * cols <= pool.numel(), (
        f"matrix [{rows}, {cols}] at offset {offset} overruns a pool of {pool.numel()} elements"
    )
    return pool.as_strided((cols, rows), (1, cols), pool.storage_offset() + offset)


def _check(out: torch.Tensor, inp: torch.Tensor, pool: torch.Tensor) -> None:
    assert out.dim() == inp.dim() == 2 and out.shape[0] == inp.shape[0], (
        f"row counts differ: {tuple(out.shape)} vs {tuple(inp.shape)}"
    )
    assert pool.dim() == 1 and pool.is_contiguous(), "pool must be a contiguous 1-D tensor"
    assert out.dtype == inp.dtype == pool.dtype, f"dtypes differ: out {out.dtype}, input {inp.dtype}, pool {pool.dtype}"


def lora_sgmv(
    y: torch.Tensor,
    x: torch.Tensor,
    seg_starts: IntSeq,
    seg_slots: IntSeq,
    pool: torch.Tensor,
    a_offsets: IntSeq,
    b_offsets: IntSeq,
    ranks: IntSeq,
) -> None:
    """Add each segment's LoRA delta to `y` in place (shrink and expand fused per segment).

    Semantics:
        for s in range(len(seg_slots)):
            rows = slice(seg_starts[s], seg_starts[s + 1]); k = seg_slots[s]; r = ranks[k]
            if r == 0: continue
            A = pool[a_offsets[k] : a_offsets[k] + r * in_features].view(r, in_features)
            B_t = pool[b_offsets[k] : b_offsets[k] + r * out_features].view(r, out_features)
            y[rows] += (x[rows] @ A.T) @ B_t
        # rows outside every segment are left untouched

    Shapes:
        y:          [T, out_features]  may be a strided column slice of a wider output (q of qkv)
        x:          [T, in_features]
        seg_starts: [S + 1]            nondecreasing row boundaries; empty segments are allowed
        seg_slots:  [S]                slot index into a_offsets / b_offsets / ranks
        pool:       [N]                contiguous, same dtype as x and y
        a_offsets:  [num_slots]        element offset of A [rank, in_features]
        b_offsets:  [num_slots]        element offset of B.T [rank, out_features], scale folded in
        ranks:      [num_slots]        0 skips the slot
    """
    _check(y, x, pool)
    d_in, d_out = x.shape[1], y.shape[1]
    a_off, b_off = _ints(a_offsets), _ints(b_offsets)
    for k, r, x_rows, y_rows in _segments(seg_starts, seg_slots, ranks, x, y):
        a_t = _view_t(pool, a_off[k], r, d_in)  # [in, r]
        b_t = _view(pool, b_off[k], r, d_out)  # [r, out]
        y_rows.addmm_(torch.mm(x_rows, a_t), b_t)


def lora_shrink(
    h: torch.Tensor,
    x: torch.Tensor,
    seg_starts: IntSeq,
    seg_slots: IntSeq,
    pool: torch.Tensor,
    a_offsets: IntSeq,
    ranks: IntSeq,
) -> None:
    """Project each segment's rows down to its adapter's rank, written into `h` in place.

    Semantics:
        for s in range(len(seg_slots)):
            rows = slice(seg_starts[s], seg_starts[s + 1]); k = seg_slots[s]; r = ranks[k]
            if r == 0: continue
            A = pool[a_offsets[k] : a_offsets[k] + r * in_features].view(r, in_features)
            h[rows, :r] = x[rows] @ A.T
        # h[rows, r:] and rows outside every segment are left untouched

    Shapes:
        h:          [T, max_rank]      max_rank >= every rank used
        x:          [T, in_features]
        seg_starts: [S + 1]
        seg_slots:  [S]
        pool:       [N]
        a_offsets:  [num_slots]
        ranks:      [num_slots]
    """
    _check(h, x, pool)
    d_in = x.shape[1]
    a_off = _ints(a_offsets)
    for k, r, x_rows, h_rows in _segments(seg_starts, seg_slots, ranks, x, h):
        assert r <= h.shape[1], f"rank {r} exceeds h's {h.shape[1]} columns"
        torch.mm(x_rows, _view_t(pool, a_off[k], r, d_in), out=h_rows[:, :r])


def lora_expand(
    y: torch.Tensor,
    h: torch.Tensor,
    seg_starts: IntSeq,
    seg_slots: IntSeq,
    pool: torch.Tensor,
    b_offsets: IntSeq,
    ranks: IntSeq,
) -> None:
    """Project each segment's rank-space rows back up and add them to `y` in place.

    Semantics:
        for s in range(len(seg_slots)):
            rows = slice(seg_starts[s], seg_starts[s + 1]); k = seg_slots[s]; r = ranks[k]
            if r == 0: continue
            B_t = pool[b_offsets[k] : b_offsets[k] + r * out_features].view(r, out_features)
            y[rows] += h[rows, :r] @ B_t
        # rows outside every segment are left untouched

    Shapes:
        y:          [T, out_features]  may be a strided column slice of a wider output
        h:          [T, max_rank]      only h[rows, :r] is read
        seg_starts: [S + 1]
        seg_slots:  [S]
        pool:       [N]
        b_offsets:  [num_slots]
        ranks:      [num_slots]
    """
    _check(y, h, pool)
    d_out = y.shape[1]
    b_off = _ints(b_offsets)
    for k, r, h_rows, y_rows in _segments(seg_starts, seg_slots, ranks, h, y):
        y_rows.addmm_(h_rows[:, :r], _view(pool, b_off[k], r, d_out))


def lora_sgmv_group(
    y: torch.Tensor,
    x: torch.Tensor,
    seg_starts: IntSeq,
    seg_slots: IntSeq,
    pool: torch.Tensor,
    a_offsets: IntSeq,
    ranks: Sequence[IntSeq],
    b_offsets: Sequence[IntSeq],
    out_cols: Sequence[int],
) -> None:
    """Add each segment's LoRA deltas for a group of modules that share their input (q/k/v, gate/up; or
    one module alone) to their fused output `y`, in place: one shrink for the whole group per segment.

    A slot's group region holds the A of every module it targets stacked in module order, `[R, in]` with
    R the sum of those ranks (a rank-0 module has no rows), then each module's scale-folded B.

    Semantics:
        for s in range(len(seg_slots)):
            rows = slice(seg_starts[s], seg_starts[s + 1]); k = seg_slots[s]
            R = sum(ranks[m][k] for m in modules)
            if R == 0: continue
            A = pool[a_offsets[k] : a_offsets[k] + R * in_features].view(R, in_features)
            h = x[rows] @ A.T                                   # [rows, R], one matmul for the group
            c = 0
            for m in modules:
                r = ranks[m][k]
                if r == 0: continue
                B_t = pool[b_offsets[m][k] : ... + r * out_m].view(r, out_m)
                y[rows, out_cols[m] : out_cols[m + 1]] += h[:, c : c + r] @ B_t
                c += r
        # rows outside every segment, and modules a slot does not target, are left untouched

    Shapes:
        y:          [T, out_cols[-1]]   the group's fused output; module m owns columns out_cols[m:m+2]
        x:          [T, in_features]
        seg_starts: [S + 1];  seg_slots: [S]
        pool:       [N]                 contiguous, same dtype as x and y
        a_offsets:  [num_slots]         element offset of the stacked A [R, in_features]
        ranks:      [M][num_slots]      rank of module m for each slot; 0: not targeted
        b_offsets:  [M][num_slots]      element offset of module m's B.T [rank, out_m]
        out_cols:   [M + 1]             column boundaries of the modules in y
    """
    _check(y, x, pool)
    assert len(ranks) == len(b_offsets) == len(out_cols) - 1, "one rank and one B table per module"
    d_in = x.shape[1]
    a_off = _ints(a_offsets)
    rank_of = [_ints(r) for r in ranks]
    b_off = [_ints(b) for b in b_offsets]
    spans = _spans(seg_starts, seg_slots, x.shape[0])
    if not spans:
        return
    # Segments tile [lo, hi) (empty ones dropped): row blocks by one `split` per tensor, cheaper than
    # slicing per segment (as in `_segments`).
    lo, hi = spans[0][1], spans[-1][2]
    sizes = [end - first for _, first, end in spans]
    x_blocks = x[lo:hi].split(sizes)
    out_blocks = [y[lo:hi, c0:c1].split(sizes) for c0, c1 in zip(out_cols, out_cols[1:], strict=False)]
    for s, (k, _, _) in enumerate(spans):
        module_ranks = [r[k] for r in rank_of]
        big_r = sum(module_ranks)
        if not big_r:
            continue
        h = torch.mm(x_blocks[s], _view_t(pool, a_off[k], big_r, d_in))  # [rows, R]: the group's one shrink
        c = 0
        for m, r in enumerate(module_ranks):
            if r:
                out = out_blocks[m][s]
                out.addmm_(h[:, c : c + r], _view(pool, b_off[m][k], r, out.shape[1]))
                c += r


def lora_bmm_group(
    y: torch.Tensor,
    x: torch.Tensor,
    gather: torch.Tensor | slice,
    mask: torch.Tensor | None,
    a_stack: torch.Tensor,
    b_stacks: Sequence[torch.Tensor | None],
    h_cols: Sequence[int],
    out_cols: Sequence[int],
) -> None:
    """The group's LoRA deltas for a step whose adapter rows are few per adapter (decoding): every adapter of the
    step at once, in batched matmuls over weights stacked per step (engine/lora/stacks.py), instead of a shrink and
    an expand per segment and module (`lora_sgmv_group`, which computes the same sums).

    Semantics (U adapters, n rows each after padding, fp32 products whatever y's dtype):
        rows = gather.view(U, n)                      # adapter u's rows of y and x; padding repeats a row
        h = x[rows] @ a_stack.transpose(1, 2)         # [U, n, R]: the group's one shrink
        h *= mask                                     # [U, n, 1]: 0 on padding rows (None: no padding)
        for m, B in enumerate(b_stacks):              # B [U, R_m, out_m] (None: no adapter targets m)
            y[rows, out_cols[m] : out_cols[m + 1]] += h[:, :, h_cols[m] : h_cols[m + 1]] @ B
        # every other row of y is left untouched; padding rows add exact zeros

    Shapes:
        y:        [T, out_cols[-1]]  the group's fused output, any float dtype
        x:        [T, in_features]   y's dtype
        gather:   [U * n] int64      row indices into x and y; or a slice of rows, when they run in order unpadded
        a_stack:  [U, R, in] fp32    each adapter's A rows for the group's modules at h_cols, zero-padded
        b_stacks: [M] of [U, R_m, out_m] fp32, R_m = h_cols[m + 1] - h_cols[m], zero-padded rows
    """
    num, rank, d_in = a_stack.shape
    if isinstance(gather, slice):  # rows gather[0] .. in order, no padding: views instead of gathers
        xs, y_rows, index = x[gather].view(num, -1, d_in), y[gather], None
    else:
        xs, y_rows, index = x.index_select(0, gather).view(num, -1, d_in), y, gather
    h = torch.bmm(xs if xs.dtype == a_stack.dtype else xs.to(a_stack.dtype), a_stack.transpose(1, 2))
    if mask is not None:
        h.mul_(mask)
    for m, b in enumerate(b_stacks):
        if b is None:
            continue
        d = torch.bmm(h[:, :, h_cols[m] : h_cols[m + 1]], b).view(-1, b.shape[2])
        d = d if d.dtype == y.dtype else d.to(y.dtype)
        if index is None:
            y_rows[:, out_cols[m] : out_cols[m + 1]].add_(d)
        else:
            y[:, out_cols[m] : out_cols[m + 1]].index_add_(0, index, d)


def dora_scale_group(
    y: torch.Tensor,
    seg_starts: IntSeq,
    seg_slots: IntSeq,
    pool: torch.Tensor,
    g_offsets: IntSeq,
    bias: torch.Tensor | None = None,
) -> None:
    """Rescale the rows of each DoRA segment of a group's output in place: `y` holds the base projection plus the
    LoRA deltas (W x + bias + B A x), and DoRA's output is g ⊙ (W x + B A x) + bias (engine/lora/dora.py), that is
    g ⊙ y + (1 − g) ⊙ bias, with g the slot's row scales over the group's columns.

    Semantics (products in fp32, rounded once to y's dtype):
        for s in range(len(seg_slots)):
            rows = slice(seg_starts[s], seg_starts[s + 1]); k = seg_slots[s]
            if g_offsets[k] < 0: continue                   # no DoRA for this slot here: rows untouched
            g = pool[g_offsets[k] : g_offsets[k] + out_features]
            y[rows] = g * y[rows] + (1 - g) * bias          # bias None: 0
        # rows outside every segment are left untouched

    Shapes:
        y:          [T, out_features]  the group's fused output
        seg_starts: [S + 1];  seg_slots: [S]
        pool:       [N]                contiguous
        g_offsets:  [num_slots]        element offset of the slot's g [out_features]; -1: none
        bias:       [out_features] or None
    """
    out = y.shape[1]
    offsets = _ints(g_offsets)
    for k, lo, hi in _spans(seg_starts, seg_slots, y.shape[0]):
        if offsets[k] < 0:
            continue
        g = _view(pool, offsets[k], 1, out).float()
        rows = y[lo:hi].float() * g
        if bias is not None:
            rows += (1 - g) * bias.float()
        y[lo:hi] = rows
