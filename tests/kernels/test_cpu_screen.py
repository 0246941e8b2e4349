"""The greedy screen of a wide fp32 LM head: engine/model/head_screen.py `HeadScreen.tokens` (loragate_kernels/cpu/
screen.cpp's bf16 screen, then cpu/panels.cpp's `panel_columns`) against the argmax of the full fp32 head
(`panel_linear`, then torch's argmax over the columns left after the bans): random heads, heads with exact ties
(duplicate rows: the lowest id wins) and near ties (rows one ulp apart), vocabularies that fill no whole panel, bans
that hit the argmax, 1 and 2 threads. `panel_columns` against `panel_linear`'s columns to the bit; the screen's column
set against a float64 reference of the bound; the layout against the weight; the rows it cannot vouch for; bad
arguments refused with an error.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.model.head_screen import CAP, HeadScreen, slack_factor
from loragate_kernels.backends import Machine

pytestmark = pytest.mark.skipif(
    not (Machine.probe("cpu").panels and Machine.probe("cpu").bf16_dot),
    reason="this CPU or build has no AVX-512 with the bf16 dot instruction",
)


def head(vocab: int, hidden: int, seed: int) -> tuple[torch.Tensor, HeadScreen]:
    weight = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(seed)) * 0.05
    return weight, screen_of(weight)


def screen_of(weight: torch.Tensor) -> HeadScreen:
    return HeadScreen(weight, torch.ops.loragate_cpu.panel_pack_weight(weight))


def full_argmax(screen: HeadScreen, hidden: torch.Tensor, banned: list[int]) -> list[int]:
    logits = torch.ops.loragate_cpu.panel_linear(hidden, screen.panels, None, screen.vocab)
    logits[:, banned] = -math.inf
    return logits.argmax(dim=1).tolist()  # the first maximal index


def hidden_rows(rows: int, hidden: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("vocab", "hidden"), [(1, 2), (95, 64), (97, 130), (4000, 576), (49152, 64)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 32, 37])
def test_tokens_are_the_full_heads_argmax(threads: int, vocab: int, hidden: int, rows: int) -> None:
    torch.set_num_threads(threads)
    _, screen = head(vocab, hidden, seed=vocab + hidden)
    x = hidden_rows(rows, hidden, seed=rows, scale=4.0)
    assert screen.tokens(x, torch.empty(0, dtype=torch.long)) == full_argmax(screen, x, [])


@pytest.mark.parametrize("threads", [1, 2])
def test_bans_hit_the_argmax(threads: int) -> None:
    torch.set_num_threads(threads)
    _, screen = head(3000, 96, seed=1)
    x = hidden_rows(9, 96, seed=2, scale=8.0)
    top = full_argmax(screen, x, [])
    banned = sorted(set(top[:4]) | {0, 2999})
    got = screen.tokens(x, torch.tensor(banned))
    assert got == full_argmax(screen, x, banned)
    assert not set(got) & set(banned)


@pytest.mark.parametrize("threads", [1, 2])
def test_exact_ties_go_to_the_lowest_id_and_near_ties_are_resolved_exactly(threads: int) -> None:
    torch.set_num_threads(threads)
    weight = torch.randn(2000, 64, generator=torch.Generator().manual_seed(3)) * 0.05
    x = hidden_rows(6, 64, seed=4, scale=4.0)
    top = full_argmax(screen_of(weight), x, [])
    for row, t in enumerate(top):
        spot = (t * 7 + 101 * (row + 1)) % 2000
        if row % 2:  # the same row at a lower or higher id: an exact tie
            weight[spot] = weight[t]
        else:  # one ulp away in one weight: the fp32 logits differ in their last bits, the bf16 ones not at all
            weight[spot] = weight[t]
            weight[spot, 0] = torch.nextafter(weight[t, 0], torch.tensor(math.inf if x[row, 0] > 0 else -math.inf))
    screen = screen_of(weight)
    assert screen.tokens(x, torch.empty(0, dtype=torch.long)) == full_argmax(screen, x, [])


def test_the_column_set_holds_what_the_bound_cannot_rule_out() -> None:
    """Against a float64 reference of the screen's logits (bf16 operands, exact products): every column whose
    reference a + e clears the reference L by more than the fp32 sums' rounding is kept, and no column is kept that
    falls short of it by more."""
    torch.set_num_threads(2)
    vocab, hidden, rows = 5000, 256, 8
    weight, screen = head(vocab, hidden, seed=5)
    x = hidden_rows(rows, hidden, seed=6, scale=3.0)
    size = x.double().norm(dim=1)
    slack = (size * screen.factor).float()
    cols, counts = torch.ops.loragate_cpu.screen_columns(
        x.bfloat16(), screen.packed, screen.norms, slack, torch.empty(0, dtype=torch.long), vocab, CAP
    )
    a = x.bfloat16().double() @ weight.bfloat16().double().T  # [rows, vocab]
    e = slack.double()[:, None] * screen.norms.double()[None, :]
    floor = (a - e).max(dim=1, keepdim=True).values
    rounding = 2 * slack_factor(hidden) * (x.double().abs() @ weight.double().abs().T).max()
    for row in range(rows):
        kept = set(cols[row, : counts[row]].tolist())
        margin = (a[row] + e[row] - floor[row]).tolist()
        assert {j for j in range(vocab) if margin[j] > rounding} <= kept
        assert all(margin[j] >= -rounding for j in kept)
        assert cols[row, : counts[row]].tolist() == sorted(kept)  # ascending
        assert 0 < len(kept) < 100  # a handful, as the bound is tight


def test_rows_it_cannot_vouch_for_are_left_to_the_full_head() -> None:
    torch.set_num_threads(2)
    _, screen = head(500, 64, seed=7)
    x = hidden_rows(5, 64, seed=8)
    x[1, 3] = math.nan
    x[2, 0] = math.inf
    x[3] *= 1e36  # its sums could overflow fp32
    got = screen.tokens(x, torch.empty(0, dtype=torch.long))
    assert got[1:4] == [None, None, None]
    assert got[0] == full_argmax(screen, x[:1], [])[0] and got[4] == full_argmax(screen, x[4:], [])[0]
    # every token banned: no token to vouch for
    assert screen.tokens(x[:1], torch.arange(500)) == [None]
    # more columns than CAP tie: the row's screen is void
    flat = screen_of(torch.ones(CAP + 500, 64))
    assert flat.tokens(hidden_rows(2, 64, seed=9), torch.empty(0, dtype=torch.long)) == [None, None]


@pytest.mark.parametrize(("n", "k"), [(1, 8), (97, 65), (300, 640), (1000, 130)])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_columns_are_panel_linears_columns_to_the_bit(n: int, k: int, bias: bool) -> None:
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(n + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(7, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    panels = torch.ops.loragate_cpu.panel_pack_weight(w)
    full = torch.ops.loragate_cpu.panel_linear(x, panels, b, n)
    cols = torch.randint(-1, n, (7, 19), generator=g)
    got = torch.ops.loragate_cpu.panel_columns(x, panels, b, n, cols)
    want = torch.where(cols >= 0, full.gather(1, cols.clamp(min=0)), -math.inf)
    assert torch.equal(got, want)


def test_the_layout_holds_the_bf16_weight() -> None:
    w = torch.randn(200, 10)
    packed = torch.ops.loragate_cpu.screen_pack(w)
    assert packed.shape == (3, 5, 96, 2) and packed.dtype == torch.bfloat16
    # [panel, K pair, column, pair member] back to [row, K]
    rows = packed.permute(0, 2, 1, 3).reshape(3 * 96, 10)
    assert torch.equal(rows[:200], w.bfloat16())
    assert not rows[200:].any()


def test_bad_arguments_are_refused() -> None:
    ops = torch.ops.loragate_cpu
    with pytest.raises(RuntimeError, match="must be even"):
        ops.screen_pack(torch.randn(10, 5))
    packed = ops.screen_pack(torch.randn(100, 8))
    x, norms, slack = torch.randn(2, 8).bfloat16(), torch.ones(100), torch.ones(2)
    none = torch.empty(0, dtype=torch.long)
    with pytest.raises(RuntimeError, match="columns"):
        ops.screen_columns(torch.randn(2, 6).bfloat16(), packed, norms, slack, none, 100, 64)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        ops.screen_columns(x, packed, norms, slack, torch.tensor([100]), 100, 64)
    with pytest.raises(RuntimeError, match="n_valid"):
        ops.screen_columns(x, packed, norms, slack, none, 193, 64)
    with pytest.raises(RuntimeError, match="slack"):
        ops.screen_columns(x, packed, norms, torch.ones(3), none, 100, 64)
    with pytest.raises(RuntimeError, match="x must be"):
        ops.screen_columns(torch.randn(2, 8), packed, norms, slack, none, 100, 64)
    panels = ops.panel_pack_weight(torch.randn(100, 8))
    with pytest.raises(RuntimeError, match="outside"):
        ops.panel_columns(torch.randn(2, 8), panels, None, 100, torch.tensor([[0, 100], [1, 2]]))
