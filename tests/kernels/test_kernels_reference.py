"""The pure-torch LoRA twins against a naive per-row float64 oracle written here.

Sweeps rank x hidden size x adapter popularity x dtype. Every case also has rows outside all
segments, an empty segment and a rank-0 segment (all must stay bit-identical), `y` as a strided
column slice of a wider tensor, and adapters at unaligned, shuffled offsets in a pool region that is
itself a slice of a larger tensor, with NaN in every pool element no adapter owns (any over-read
shows up as NaN).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from loragate_kernels.reference import lora_expand, lora_sgmv, lora_shrink

RANKS = [1, 2, 4, 8, 16, 32, 64]
HIDDEN = [(16, 16), (64, 24), (576, 192), (96, 1536)]
POPULARITY = ["distinct", "uniform", "skewed", "identical"]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # relative to the largest |delta|


@dataclass
class Case:
    y_wide: torch.Tensor  # [T, out + 7]; y is columns 3 : 3 + out
    x: torch.Tensor  # [T, in]
    seg_starts: list[int]
    seg_slots: list[int]
    pool: torch.Tensor  # a slice of a larger tensor
    a_offsets: list[int]
    b_offsets: list[int]
    ranks: list[int]
    out: int

    @property
    def y(self) -> torch.Tensor:
        return self.y_wide[:, 3 : 3 + self.out]

    def tables(self) -> tuple:
        return self.seg_starts, self.seg_slots, self.pool


def segment_plan(popularity: str) -> list[int]:
    """Rows per adapter segment; segment s uses adapter s."""
    return {"distinct": [1] * 9, "uniform": [3] * 4, "skewed": [13, 1, 1, 1], "identical": [11]}[popularity]


def make_case(d_in: int, d_out: int, max_rank: int, popularity: str, dtype: torch.dtype, seed: int = 0) -> Case:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    lens = segment_plan(popularity)
    n = len(lens)
    # Heterogeneous ranks up to max_rank, plus one slot (the last) that does not target this module.
    ranks = [max(1, max_rank >> (i % 3)) for i in range(n)] + [0]
    # Lay A_k and B_k out in a shuffled order with odd gaps, so slots interleave and nothing is aligned.
    blocks = [(k, "a", r * d_in) for k, r in enumerate(ranks)]
    blocks += [(k, "b", d_out * r) for k, r in enumerate(ranks)]
    rng.shuffle(blocks)
    a_offsets, b_offsets = [0] * len(ranks), [0] * len(ranks)
    cursor = rng.randrange(1, 8)
    for k, which, size in blocks:
        (a_offsets if which == "a" else b_offsets)[k] = cursor
        cursor += size + rng.randrange(1, 8)
    backing = torch.full((cursor + 40,), float("nan"), dtype=dtype)
    pool = backing[11 : 11 + cursor + 20]
    for k, r in enumerate(ranks):
        pool[a_offsets[k] : a_offsets[k] + r * d_in] = torch.randn(r * d_in, generator=g) * 0.2
        pool[b_offsets[k] : b_offsets[k] + d_out * r] = torch.randn(d_out * r, generator=g) * 0.2
    # Segments: 2 untouched rows, the adapters (an empty segment after the first, the rank-0 slot
    # before the last), 3 untouched rows.
    seg_lens = lens[:1] + [0] + lens[1:-1] + [2] + lens[-1:] if n > 1 else [0] + lens + [2]
    seg_slots = [0, 1 % n] + list(range(1, n - 1)) + [n] + [n - 1] if n > 1 else [0, 0, n]
    seg_starts = [2]
    for length in seg_lens:
        seg_starts.append(seg_starts[-1] + length)
    t = seg_starts[-1] + 3
    x = torch.randn(t, d_in, generator=g).to(dtype)
    y_wide = torch.randn(t, d_out + 7, generator=g).to(dtype)
    return Case(y_wide, x, seg_starts, seg_slots, pool, a_offsets, b_offsets, ranks, d_out)


def oracle(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row, in float64: (delta [T, out], h [T, max_rank], touched [T] bool)."""
    t, d_in = case.x.shape
    delta = torch.zeros(t, case.out, dtype=torch.float64)
    h = torch.zeros(t, max(case.ranks), dtype=torch.float64)
    touched = torch.zeros(t, dtype=torch.bool)
    for row in range(t):
        owner = [s for s in range(len(case.seg_slots)) if case.seg_starts[s] <= row < case.seg_starts[s + 1]]
        if not owner:
            continue
        k = case.seg_slots[owner[0]]
        r = case.ranks[k]
        if r == 0:
            continue
        a = case.pool[case.a_offsets[k] : case.a_offsets[k] + r * d_in].double().reshape(r, d_in)
        b_t = case.pool[case.b_offsets[k] : case.b_offsets[k] + r * case.out].double().reshape(r, case.out)
        h[row, :r] = a @ case.x[row].double()
        delta[row] = h[row, :r] @ b_t  # the pool stores B transposed
        touched[row] = True
    return delta, h, touched


def assert_update(case: Case, y_wide_before: torch.Tensor, delta: torch.Tensor, touched: torch.Tensor) -> None:
    """Inside y's columns, touched rows gained delta; every other element is bit-identical."""
    y_after, y_before = case.y, y_wide_before[:, 3 : 3 + case.out]
    scale = max(delta.abs().max().item(), 1.0)
    tol = TOLERANCE[case.x.dtype] * scale
    torch.testing.assert_close(y_after[touched].double(), y_before[touched].double() + delta[touched], rtol=0, atol=tol)
    assert torch.equal(y_after[~touched], y_before[~touched])
    assert torch.equal(case.y_wide[:, :3], y_wide_before[:, :3])
    assert torch.equal(case.y_wide[:, 3 + case.out :], y_wide_before[:, 3 + case.out :])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("hidden", HIDDEN, ids=[f"{i}x{o}" for i, o in HIDDEN])
@pytest.mark.parametrize("rank", RANKS)
def test_sgmv_shrink_expand_match_oracle(
    rank: int, hidden: tuple[int, int], popularity: str, dtype: torch.dtype
) -> None:
    case = make_case(*hidden, rank, popularity, dtype, seed=rank * 31 + hidden[1])
    delta, h_ref, touched = oracle(case)
    before = case.y_wide.clone()

    lora_sgmv(case.y, case.x, *case.tables(), case.a_offsets, case.b_offsets, case.ranks)
    assert_update(case, before, delta, touched)

    # The two halves on their own: shrink writes only h[rows, :r], expand adds h[rows, :r] @ B.T.
    h = torch.full((case.x.shape[0], max(case.ranks) + 2), float("nan"), dtype=dtype)
    lora_shrink(h, case.x, *case.tables(), case.a_offsets, case.ranks)
    written = torch.zeros_like(h, dtype=torch.bool)
    for s, k in enumerate(case.seg_slots):
        written[case.seg_starts[s] : case.seg_starts[s + 1], : case.ranks[k]] = True
    h_scale = max(h_ref.abs().max().item(), 1.0)
    torch.testing.assert_close(h[written].double(), h_ref[written[:, :-2]], rtol=0, atol=TOLERANCE[dtype] * h_scale)
    assert torch.isnan(h[~written]).all()

    case.y_wide.copy_(before)
    lora_expand(case.y, h, *case.tables(), case.b_offsets, case.ranks)
    assert_update(case, before, delta, touched)


def test_index_tensors_give_the_same_result() -> None:
    case = make_case(64, 24, 8, "uniform", torch.float32)
    expected = case.y_wide.clone()
    lora_sgmv(expected[:, 3 : 3 + case.out], case.x, *case.tables(), case.a_offsets, case.b_offsets, case.ranks)
    as_tensors = [torch.tensor(v) for v in (case.seg_starts, case.seg_slots)]
    lora_sgmv(
        case.y,
        case.x,
        *as_tensors,
        case.pool,
        torch.tensor(case.a_offsets),
        torch.tensor(case.b_offsets),
        torch.tensor(case.ranks),
    )
    assert torch.equal(case.y_wide, expected)


def test_strided_x_matches_contiguous_x() -> None:
    case = make_case(64, 24, 16, "skewed", torch.float32)
    wide_x = torch.randn(case.x.shape[0], 64 + 5)
    wide_x[:, 5:] = case.x
    expected = case.y_wide.clone()
    lora_sgmv(expected[:, 3 : 3 + case.out], case.x, *case.tables(), case.a_offsets, case.b_offsets, case.ranks)
    lora_sgmv(case.y, wide_x[:, 5:], *case.tables(), case.a_offsets, case.b_offsets, case.ranks)
    torch.testing.assert_close(case.y_wide, expected, rtol=1e-6, atol=1e-6)


def test_no_segments_and_all_rank_zero_leave_y_untouched() -> None:
    case = make_case(16, 16, 4, "uniform", torch.float32)
    before = case.y_wide.clone()
    lora_sgmv(case.y, case.x, [0], [], case.pool, case.a_offsets, case.b_offsets, case.ranks)
    zero_ranks = [0] * len(case.ranks)
    lora_sgmv(case.y, case.x, *case.tables(), case.a_offsets, case.b_offsets, zero_ranks)
    h = torch.full((case.x.shape[0], 4), float("nan"))
    lora_shrink(h, case.x, *case.tables(), case.a_offsets, zero_ranks)
    lora_expand(case.y, torch.zeros_like(h), *case.tables(), case.b_offsets, zero_ranks)
    assert torch.equal(case.y_wide, before)
    assert torch.isnan(h).all()


def test_segments_sharing_a_slot_both_get_it() -> None:
    case = make_case(64, 24, 8, "uniform", torch.float32)
    case.seg_slots = [2] * len(case.seg_slots)  # every segment, including the rank-0 one, uses slot 2
    delta, _, touched = oracle(case)
    assert touched.sum() == case.seg_starts[-1] - case.seg_starts[0]
    before = case.y_wide.clone()
    lora_sgmv(case.y, case.x, *case.tables(), case.a_offsets, case.b_offsets, case.ranks)
    assert_update(case, before, delta, touched)
