"""The CPU's bf16 GEMM over its tile layout (loragate_kernels/cpu/amx.cpp), on both its kernels (AMX tiles, and the
AVX-512 bf16 dot instruction), against a float64 oracle and oneDNN: row counts that fill the tiles and that do not
(padded to 16 on AMX; 4-row tiles and their remainders on the dot kernel), one and two row tiles, several column
blocks (runs of 3 on the dot kernel, and the 1 or 2 left over) split over 1 and 2 threads, a bias, inputs with padded
row strides, prefill-sized row counts; bad arguments refused with an error. And engine/model/cpu_gemm.py's
PackedLinear taking the layout for bf16 layers whose dims are multiples of 32 (oneDNN otherwise). Each kernel is
skipped where the CPU or build lacks it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.cpu_gemm import PackedLinear
from loragate_kernels.backends import Gemm, Machine, onednn_available

MACHINE = Machine.probe("cpu")
pytestmark = pytest.mark.skipif(not (MACHINE.amx or MACHINE.bf16_dot), reason="no AMX tiles, no AVX-512 bf16")
KERNELS = [
    pytest.param("amx", marks=pytest.mark.skipif(not MACHINE.amx, reason="the CPU has no AMX tiles")),
    pytest.param("dot", marks=pytest.mark.skipif(not MACHINE.bf16_dot, reason="the CPU has no AVX-512 bf16")),
]
ROUTE = Gemm.AMX if MACHINE.amx else Gemm.DOT  # what a bf16 model's GEMMs take here


def tiled(kernel: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T + b through the tile layout on `kernel`: "amx" (amx_linear where AMX runs) or "dot" (dot_linear)."""
    op = torch.ops.loragate_cpu.amx_linear if kernel == "amx" else torch.ops.loragate_cpu.dot_linear
    return op(x, torch.ops.loragate_cpu.amx_pack_weight(w), b)


def operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    return x, (torch.randn(n, k, generator=g) * 0.05).bfloat16(), torch.randn(n, generator=g).bfloat16()


def close_to_oracle(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """The exact product rounded once to bf16 (half an ulp, 2^-8 relative), give or take fp32 summation (relative to
    the sum of |terms|)."""
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    scale = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    excess = (got.double() - want).abs() - want.abs() * 2**-8 - scale * 1e-6
    assert excess.max().item() <= 0, excess.max().item()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 15, 16, 17, 31, 32, 33, 48, 64])
@pytest.mark.parametrize(("n", "k"), [(32, 32), (96, 576), (64, 1536), (160, 64)])
def test_matches_the_oracle(kernel: str, m: int, n: int, k: int, threads: int) -> None:
    torch.set_num_threads(threads)
    x, w, b = operands(m, n, k, seed=m * 1000 + n + k)
    close_to_oracle(tiled(kernel, x, w), x, w, None)
    close_to_oracle(tiled(kernel, x, w, b), x, w, b)


@pytest.mark.parametrize("kernel", KERNELS)
def test_prefill_rows_wide_weights_and_strided_inputs(kernel: str) -> None:
    """512 and 100 rows (several passes of 32 over each block while it is in cache), an LM-head-like weight over
    many blocks, and x a slice of a wider tensor (its rows further apart than its width)."""
    torch.set_num_threads(2)
    x, w, b = operands(512, 192, 576, seed=1)
    close_to_oracle(tiled(kernel, x, w, b), x, w, b)
    wide, w2, _ = operands(100, 4096, 576 + 64, seed=2)
    w2 = w2[:, :576].contiguous()
    for rows in (100, 96):  # padded to 16 rows in a copy; read in place, its stride as it is
        x2 = wide[:rows, :576]
        assert x2.stride(0) != x2.shape[1]
        close_to_oracle(tiled(kernel, x2, w2), x2, w2, None)


@pytest.mark.parametrize("kernel", KERNELS)
def test_as_close_as_onednn(kernel: str) -> None:
    """On a decode step's qkv shape the kernel's outputs and oneDNN's are each the exact product rounded once:
    they agree to within one bf16 ulp everywhere."""
    if not onednn_available():
        pytest.skip("no oneDNN")
    x, w, _ = operands(32, 960, 576, seed=3)
    onednn = torch.ops.mkldnn._linear_pointwise(
        x, torch.ops.mkldnn._reorder_linear_weight(w, 32), None, "none", [], ""
    ).double()
    ulp = torch.finfo(torch.bfloat16).eps * onednn.abs().clamp_min(1e-3)
    assert ((tiled(kernel, x, w).double() - onednn).abs() <= ulp).all()


@pytest.mark.parametrize(
    ("x", "w", "b", "message"),
    [
        (torch.zeros(4, 64).bfloat16(), torch.zeros(32, 33).bfloat16(), None, "multiples of 32"),
        (torch.zeros(4, 64).bfloat16(), torch.zeros(48, 64).bfloat16(), None, "multiples of 32"),
        (torch.zeros(4, 64), torch.zeros(32, 64).bfloat16(), None, "bf16"),
        (torch.zeros(4, 96).bfloat16(), torch.zeros(32, 64).bfloat16(), None, "columns"),
        (torch.zeros(4, 64).bfloat16(), torch.zeros(32, 64).bfloat16(), torch.zeros(31).bfloat16(), "bias"),
        (torch.zeros(64, 4).bfloat16().T, torch.zeros(32, 64).bfloat16(), None, "contiguous columns"),
    ],
)
@pytest.mark.parametrize("kernel", KERNELS)
def test_bad_arguments_are_refused(
    kernel: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, message: str
) -> None:
    with pytest.raises(RuntimeError, match=message):
        tiled(kernel, x, w, b)


def test_packed_linear_takes_the_tile_layout_for_bf16_layers_of_whole_blocks() -> None:
    torch.set_num_threads(2)
    x, w, b = operands(40, 96, 576, seed=4)
    layer = PackedLinear(w, b, ROUTE, torch.bfloat16)
    assert layer.tiles and "cpu/amx.cpp" in layer.extra_repr()
    close_to_oracle(layer(x), x, w, b)
    close_to_oracle(layer(x[:3]), x[:3], w, b)
    odd = PackedLinear(w[:40], b[:40], ROUTE, torch.bfloat16)  # 40 output columns: not whole blocks of 32
    assert not odd.tiles and "oneDNN" in odd.extra_repr()
    torch.testing.assert_close(
        odd(x), F.linear(x.float(), w[:40].float(), b[:40].float()).bfloat16(), rtol=8e-3, atol=8e-3
    )
