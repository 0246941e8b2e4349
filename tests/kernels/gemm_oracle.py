"""What the CPU's fp32 GEMM kernels (tests/kernels/test_cpu_gemm.py, test_cpu_panels.py) are held to: a float64 oracle
as close as F.linear comes to it, and the same results for strided, empty and non-finite inputs."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Linear = Callable[..., torch.Tensor]  # (x [M, K], w [N, K], bias [N] or None) -> [M, N]


def operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g)


def close_to_oracle(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """Within fp32 rounding of a K-term sum (relative to the sum of |terms|), and as close to it as F.linear is."""
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    scale = x.double().abs() @ w.double().abs().T + 1e-30
    err = ((got.double() - want).abs() / scale).max().item() if got.numel() else 0.0
    ref_err = ((F.linear(x, w, b).double() - want).abs() / scale).max().item() if got.numel() else 0.0
    assert got.shape == want.shape and got.dtype == torch.float32
    assert err <= max(4 * ref_err, 1e-6), (err, ref_err)


def check_strided_and_odd_inputs(linear: Linear) -> None:
    """Rows with padded strides and non-contiguous columns give the contiguous result bit for bit; empty shapes give
    empty results (or the bias); an inf or NaN in x reaches the outputs F.linear's does."""
    x, w, b = operands(9, 30, 100, seed=3)
    wide = torch.randn(9, 107)
    wide[:, :100] = x
    view = wide[:, :100]  # rows 107 apart
    assert view.stride(0) == 107
    torch.testing.assert_close(linear(view, w, b), linear(x, w, b), rtol=0, atol=0)
    transposed = x.T.contiguous().T  # columns not contiguous: copied first
    torch.testing.assert_close(linear(transposed, w, b), linear(x, w, b), rtol=0, atol=0)
    assert linear(torch.empty(0, 100), w).shape == (0, 30)
    assert linear(x, torch.empty(0, 100)).shape == (9, 0)
    torch.testing.assert_close(linear(torch.empty(9, 0), torch.empty(30, 0), b), b.expand(9, 30))
    assert torch.equal(linear(torch.empty(9, 0), torch.empty(30, 0)), torch.zeros(9, 30))
    inf = x.clone()
    inf[2, 5] = float("inf")
    nan = x.clone()
    nan[4, 0] = float("nan")
    assert torch.equal(linear(inf, w).isinf(), F.linear(inf, w).isinf())
    assert torch.equal(linear(nan, w).isnan(), F.linear(nan, w).isnan())
