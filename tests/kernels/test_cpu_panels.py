"""The CPU's fp32 GEMM over a panel layout of the weight (loragate_kernels/cpu/panels.cpp `panel_linear`, for CPUs
with AVX-512) against a float64 oracle and F.linear: every tile height (rows in 4s and their tails), output widths
that fill no whole panel (96 columns, zero-padded) or several, K that is no multiple of the 64-column blocks the
tile sums in registers, prompt-sized row counts, a wide LM-head-like weight (each thread asking for its next panel),
runs of rows split across threads where the panels are few, a bias, inputs with padded row strides, empty shapes;
the layout itself against the weight; bad arguments refused with an error. `panel_linear_silu` (the same GEMM of a
[gate; up] weight with the MLP's activation on its tiles) against `panel_linear` then cpu/layer.cpp's `silu_mul`, to
the bit, and against F.silu over a float64 product.
"""

from __future__ import annotations

import pytest
import torch
from gemm_oracle import check_strided_and_odd_inputs, close_to_oracle, operands

from loragate_kernels.backends import Machine

pytestmark = pytest.mark.skipif(not Machine.probe("cpu").panels, reason="this CPU or build has no AVX-512")


def pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.loragate_cpu.panel_pack_weight(w)


def panel(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.loragate_cpu.panel_linear(x, pack(w), b, w.shape[0])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 31, 32, 64])
@pytest.mark.parametrize(("n", "k"), [(1, 8), (40, 576), (96, 64), (97, 65), (200, 9), (576, 1536), (47, 2100)])
def test_matches_the_oracle(m: int, n: int, k: int, threads: int) -> None:
    torch.set_num_threads(threads)
    x, w, b = operands(m, n, k, seed=m * 1000 + n + k)
    close_to_oracle(panel(x, w), x, w, None)
    close_to_oracle(panel(x, w, b), x, w, b)


@pytest.mark.parametrize("m", [65, 130, 512])
def test_prompt_sized_row_counts(m: int) -> None:
    """Prefill steps run here too (no padding to a row bucket): one copy of the weight for every row count."""
    torch.set_num_threads(2)
    x, w, b = operands(m, 576, 192, seed=m)
    close_to_oracle(panel(x, w, b), x, w, b)


def test_wide_weights_and_rows_split_across_threads() -> None:
    """An LM-head-like weight (many panels a thread, each asking for the next) at decode widths, and one panel shared
    by 4 threads (the panels alone would leave three idle: the rows are split into runs)."""
    torch.set_num_threads(2)
    x, w, _ = operands(33, 4099, 576, seed=7)
    close_to_oracle(panel(x, w), x, w, None)
    torch.set_num_threads(4)
    x, w, b = operands(77, 90, 300, seed=8)
    got = panel(x, w, b)
    close_to_oracle(got, x, w, b)
    torch.set_num_threads(1)
    assert torch.equal(got, panel(x, w, b))  # the rows' split does not change any sum
    torch.set_num_threads(2)
    # 7 panels on 2 threads (hidden 640's o and down projections): each panel in two runs of rows, 7 items a thread
    for m in (1, 5, 32, 512):
        x, w, b = operands(m, 640, 2048, seed=9 + m)
        got = panel(x, w, b)
        close_to_oracle(got, x, w, b)
        torch.set_num_threads(1)
        assert torch.equal(got, panel(x, w, b))
        torch.set_num_threads(2)


def test_strided_and_odd_inputs() -> None:
    check_strided_and_odd_inputs(panel)


@pytest.mark.parametrize(
    ("x", "panels", "b", "n", "message"),
    [
        (torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(1, 4, 96), None, 3, "float32"),
        (torch.ones(2, 4), torch.ones(1, 5, 96), None, 3, "columns"),
        (torch.ones(2, 4), torch.ones(1, 4, 32), None, 3, "panel_pack_weight"),
        (torch.ones(2, 4), torch.ones(1, 96, 4).transpose(1, 2), None, 3, "panel_pack_weight"),
        (torch.ones(2, 4), torch.ones(1, 4, 96), None, 97, "does not fit"),
        (torch.ones(2, 4), torch.ones(2, 4, 96), None, 96, "does not fit"),
        (torch.ones(2, 4), torch.ones(1, 4, 96), torch.ones(2), 3, "bias"),
        (torch.ones(2, 4), torch.ones(1, 4, 96), torch.ones(3, dtype=torch.float64), 3, "bias"),
        (torch.ones(2, 2, 4), torch.ones(1, 4, 96), None, 3, "2-D"),
    ],
    ids=["dtype", "width", "panel-width", "panel-layout", "n-too-big", "n-too-small", "bias-size", "bias-dtype", "3-d"],
)
def test_bad_arguments_are_refused(
    x: torch.Tensor, panels: torch.Tensor, b: torch.Tensor | None, n: int, message: str
) -> None:
    with pytest.raises(RuntimeError, match=message):
        torch.ops.loragate_cpu.panel_linear(x, panels, b, n)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 32, 77, 512])
@pytest.mark.parametrize(("half", "k"), [(96, 64), (192, 65), (480, 640), (1536, 576)])
def test_the_fused_activation_equals_the_two_ops(m: int, half: int, k: int, threads: int) -> None:
    """silu(gate) * up straight from the tiles: the very floats panel_linear and silu_mul give (same sums in the same
    order, the same activation), and within fp32 rounding of F.silu over a float64 product (sums of up to ~10). Rows
    split into runs where the pairs of panels are few (half = 96: one pair)."""
    torch.set_num_threads(threads)
    x, w, b = operands(m, 2 * half, k, seed=m * 7 + half + k)
    w[:half] *= 8  # gate sums over the activation's whole range, both tails included
    packed = pack(w)
    for bias in (None, b):
        got = torch.ops.loragate_cpu.panel_linear_silu(x, packed, bias, 2 * half)
        assert got.shape == (m, half)
        two_ops = torch.ops.loragate_cpu.silu_mul(torch.ops.loragate_cpu.panel_linear(x, packed, bias, 2 * half))
        assert torch.equal(got, two_ops)
        exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
        gate, up = exact.split(half, dim=1)
        torch.testing.assert_close(got.double(), torch.nn.functional.silu(gate) * up, rtol=1e-4, atol=1e-4)
    torch.set_num_threads(2)


def test_the_fused_activation_refuses_what_it_cannot_split() -> None:
    x = torch.ones(2, 8)
    with pytest.raises(RuntimeError, match="multiple of 192"):  # gate and up would share a panel
        torch.ops.loragate_cpu.panel_linear_silu(x, pack(torch.ones(96, 8)), None, 96)
    with pytest.raises(RuntimeError, match="no columns"):
        torch.ops.loragate_cpu.panel_linear_silu(torch.ones(2, 0), torch.ones(2, 0, 96), None, 192)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.loragate_cpu.panel_linear_silu(x.double(), pack(torch.ones(192, 8)), None, 192)


def test_the_pack_refuses_what_it_cannot_lay_out() -> None:
    with pytest.raises(RuntimeError, match="2-D float32"):
        pack(torch.ones(3, 4, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="2-D float32"):
        pack(torch.ones(2, 3, 4))
