"""The CPU's GEMM for few rows (loragate_kernels/cpu/gemm.cpp `skinny_linear`) against a float64 oracle and F.linear:
every tile shape it has (rows in 4s and their tails; weight rows in 3s and chunks of 24 with AVX2, in 6s and chunks
of 48 with AVX-512, and their tails), columns that are not a multiple of a vector (masked loads), columns split into
blocks (more than 1,024), a bias, inputs with padded row strides, 1 and 2 threads, empty shapes; bad arguments
refused with an error. (Which CPUs take it: loragate_kernels/backends.py, tests/kernels/test_backends.py.)
"""

from __future__ import annotations

import pytest
import torch
from gemm_oracle import check_strided_and_odd_inputs, close_to_oracle, operands

from built_ops import require_cpu_ops


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    require_cpu_ops()


def skinny(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.loragate_cpu.skinny_linear(x, w, b)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 31, 32, 64])
@pytest.mark.parametrize(("n", "k"), [(1, 8), (2, 576), (3, 7), (25, 576), (50, 9), (96, 1536), (47, 2100)])
def test_matches_the_oracle(m: int, n: int, k: int, threads: int) -> None:
    torch.set_num_threads(threads)
    x, w, b = operands(m, n, k, seed=m * 1000 + n + k)
    close_to_oracle(skinny(x, w), x, w, None)
    close_to_oracle(skinny(x, w, b), x, w, b)


def test_wide_weights_many_chunks_and_threads() -> None:
    """An LM-head-like weight (many chunks per thread, each prefetching the next) at decode widths."""
    torch.set_num_threads(2)
    x, w, _ = operands(33, 4099, 576, seed=7)
    close_to_oracle(skinny(x, w), x, w, None)


def test_strided_and_odd_inputs() -> None:
    check_strided_and_odd_inputs(skinny)


@pytest.mark.parametrize(
    ("x", "w", "b", "message"),
    [
        (torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(3, 4), None, "float32"),
        (torch.ones(2, 4), torch.ones(3, 5), None, "columns"),
        (torch.ones(2, 4), torch.ones(4, 3).T, None, "contiguous"),
        (torch.ones(2, 4), torch.ones(3, 4), torch.ones(2), "bias"),
        (torch.ones(2, 4), torch.ones(3, 4), torch.ones(3, dtype=torch.float64), "bias"),
        (torch.ones(2, 2, 4), torch.ones(3, 4), None, "2-D"),
    ],
    ids=["dtype", "width", "weight-layout", "bias-size", "bias-dtype", "3-d"],
)
def test_bad_arguments_are_refused(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        skinny(x, w, b)
