"""The CPU's fused layer ops (loragate_kernels/cpu/layer.cpp) against a float64 oracle and their torch twins
(engine/model/layer_ops.py `TorchLayerOps`, what CUDA and compiler-less CPUs run): RMSNorm, the residual add fused
with it, SiLU-and-mul, RoPE with the K/V cache write. Inputs with padded row strides (a fused projection's slice),
1 and 2 threads, extreme activations; cache rows outside the layer refused before anything is written; the seam.
"""

from __future__ import annotations

import pytest
import torch

from engine.model.attention import AttentionPlan, key_rows
from engine.model.layer_ops import CppLayerOps, TorchLayerOps

from built_ops import require_cpu_ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    require_cpu_ops()


def strided(rows: int, cols: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    """[rows, cols] whose rows are 7 elements further apart than their width (a slice of a wider tensor)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols + 7, generator=g) * scale).to(dtype)[:, :cols]


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: a few ulps of fp32 rounding; bf16/fp16: one rounding of an fp32 result (one ulp of the dtype)."""
    tol = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)


def rms_oracle(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 9, 96])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_norms_match_the_oracle_and_torch(dtype: torch.dtype, rows: int, threads: int) -> None:
    torch.set_num_threads(threads)
    hidden, eps = 576, 1e-5
    x = strided(rows, hidden, dtype, seed=rows, scale=3.0)
    delta = strided(rows, hidden, dtype, seed=rows + 1)
    w = (torch.rand(hidden, generator=torch.Generator().manual_seed(2)) + 0.5).to(dtype)

    normed = CppLayerOps.norm(x, w, eps)
    assert normed.dtype == dtype and normed.shape == (rows, hidden)
    close(normed, rms_oracle(x, w, eps), dtype)
    close(normed, TorchLayerOps.norm(x, w, eps), dtype)

    residual = x.clone()
    want_normed, want_residual = TorchLayerOps.add_norm(x, delta, w, eps)
    got_normed, got_residual = CppLayerOps.add_norm(residual, delta, w, eps)
    assert got_residual is residual  # updated in place: the stream the next layer adds to
    # the add is one rounding of an exact fp32 sum: equal to torch's, bit for bit
    torch.testing.assert_close(residual, want_residual, rtol=0, atol=0)
    close(got_normed, rms_oracle(want_residual, w, eps), dtype)
    close(got_normed, want_normed, dtype)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_silu_mul_matches_the_oracle_and_torch(dtype: torch.dtype, threads: int) -> None:
    torch.set_num_threads(threads)
    inter = 1536
    gate_up = strided(40, 2 * inter, dtype, seed=3, scale=4.0)
    # the tails of silu: e^-x overflows fp32 past 88, underflows below -87; zero
    extremes = torch.tensor([0.0, -0.0, 1e-3, -1e-3, 20.0, -20.0, 87.5, -87.5, 89.0, -89.0, 300.0, -300.0])
    gate_up[0, : extremes.numel()] = extremes.to(dtype)
    got = CppLayerOps.silu_mul(gate_up)
    assert got.dtype == dtype and got.shape == (40, inter)
    gate, up = gate_up.double().split(inter, dim=-1)
    close(got, torch.nn.functional.silu(gate) * up, dtype)
    close(got, TorchLayerOps.silu_mul(gate_up), dtype)
    assert torch.isfinite(got).all()


def rope_tables(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, 1, hd] fp32, the sign of rotate_half folded into sin (engine/model/llama.py)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).double() / head_dim))
    freqs = positions.double()[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    sin = emb.sin()
    sin[:, : head_dim // 2] *= -1
    return emb.cos().float()[:, None], sin.float()[:, None]


def rope_case(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, tokens: int, seed: int):
    block_size, pages = 4, 12
    cache = torch.full((pages, 2, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    slots = torch.randperm(pages * block_size, generator=torch.Generator().manual_seed(seed))[:tokens]
    k_rows = key_rows(slots, block_size)
    plan = AttentionPlan(k_rows, k_rows + block_size, 0, None, None, None, 0, ())
    qkv = strided(tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype, seed=seed, scale=2.0)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(seed + 1))
    return cache, plan, qkv, positions


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 1, 32), (8, 8, 128)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rope_write_kv_matches_the_oracle_and_torch(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    tokens = 11
    cache, plan, qkv, positions = rope_case(dtype, num_heads, num_kv_heads, head_dim, tokens, seed=head_dim)
    cos, sin = rope_tables(positions, head_dim)
    original = qkv.clone()

    twin_cache = cache.clone()
    want_q, want_k, want_v = TorchLayerOps.rope_write_kv(
        original.clone(), cos.to(dtype), sin.to(dtype), twin_cache, plan, num_heads
    )
    q, k, v = CppLayerOps.rope_write_kv(qkv, cos, sin, cache, plan, num_heads)

    heads = original.double().view(tokens, -1, head_dim)
    rotated = heads[:, : num_heads + num_kv_heads]
    oracle = rotated * cos.double() + torch.roll(rotated, head_dim // 2, dims=-1) * sin.double()
    close(q, oracle[:, :num_heads], dtype)
    close(k, oracle[:, num_heads:], dtype)
    torch.testing.assert_close(v, heads[:, num_heads + num_kv_heads :].to(dtype), rtol=0, atol=0)  # not rotated
    torch.testing.assert_close(v, want_v, rtol=0, atol=0)
    for got, want, exact in ((q, want_q, oracle[:, :num_heads]), (k, want_k, oracle[:, num_heads:])):
        if dtype == torch.float32:
            close(got, want, dtype)
        else:  # torch's twin rotates in the model's dtype (three roundings, cos/sin rounded too): the op is closer
            assert (got.double() - exact).abs().max() <= (want.double() - exact).abs().max()
    assert q.data_ptr() == qkv.data_ptr()  # rotated in place: q and k are views of qkv

    flat = cache.view(-1, num_kv_heads, head_dim)
    torch.testing.assert_close(flat[plan.k_rows], k, rtol=0, atol=0)
    torch.testing.assert_close(flat[plan.v_rows], v, rtol=0, atol=0)
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[plan.k_rows] = untouched[plan.v_rows] = False
    assert flat[untouched].isnan().all()  # no other row of the layer written
    assert twin_cache.isnan().sum() == cache.isnan().sum()


@pytest.mark.parametrize("bad_row", [-1, 10**6])
def test_rope_write_kv_refuses_rows_outside_the_cache(bad_row: int) -> None:
    cache, plan, qkv, positions = rope_case(torch.float32, 4, 2, 16, 5, seed=7)
    cos, sin = rope_tables(positions, 16)
    plan.v_rows[3] = bad_row
    before_qkv, before_cache = qkv.clone(), cache.clone()
    with pytest.raises(RuntimeError, match="is not one of"):
        CppLayerOps.rope_write_kv(qkv, cos, sin, cache, plan, 4)
    torch.testing.assert_close(qkv, before_qkv, rtol=0, atol=0)  # nothing rotated, nothing written
    torch.testing.assert_close(cache, before_cache, rtol=0, atol=0, equal_nan=True)


def test_bad_arguments_are_refused() -> None:
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        CppLayerOps.norm(x, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="share a dtype"):
        CppLayerOps.norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match="match residual"):
        CppLayerOps.add_norm(x, torch.randn(2, 8), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="even number"):
        CppLayerOps.silu_mul(torch.randn(3, 7))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        CppLayerOps.silu_mul(torch.randn(3, 8, dtype=torch.float64))
    cache, plan, qkv, positions = rope_case(torch.float32, 4, 2, 16, 5, seed=8)
    cos, sin = rope_tables(positions, 16)
    with pytest.raises(RuntimeError, match=r"qkv must be \[T"):
        CppLayerOps.rope_write_kv(qkv, cos, sin, cache, plan, 5)
    with pytest.raises(RuntimeError, match="cos and sin"):
        CppLayerOps.rope_write_kv(qkv, cos.double(), sin, cache, plan, 4)
