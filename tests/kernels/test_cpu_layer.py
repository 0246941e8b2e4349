"""The CPU's fused layer ops (loragate_kernels/cpu/layer.cpp) against a float64 oracle and their torch twins
(engine/model/layer_ops.py `TorchLayerOps`, what CUDA and compiler-less CPUs run), and the twins against HF's own
modeling code (Qwen3's and Gemma 3's RMSNorm, Qwen3's and Phi-3's RoPE): RMSNorm with weights of any dtype, the residual
add fused with it (the stream in fp32), SiLU- and GELU-tanh-and-mul, RoPE (partial rotary, q/k norms) with the K/V
cache write. Inputs with padded row strides (a fused projection's slice), odd widths (the ops' scalar paths), 1 and 2
threads, extreme activations; cache rows outside the layer refused before anything is written; the seam.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_rope
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb as qwen3_rope

from engine.model.attention import AttentionPlan, key_rows
from engine.model.layer_ops import CppLayerOps, TorchLayerOps

from built_ops import require_cpu_ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


@pytest.fixture(autouse=True)
def built(request: pytest.FixtureRequest) -> None:
    """The C++ ops, for every test but the twins' own against HF's code (`test_torch_*`), which run without them."""
    if not request.node.name.startswith("test_torch_"):
        require_cpu_ops()


def strided(rows: int, cols: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    """[rows, cols] whose rows are 7 elements further apart than their width (a slice of a wider tensor)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols + 7, generator=g) * scale).to(dtype)[:, :cols]


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, roundings: int = 1) -> None:
    """fp32: a few ulps of fp32 rounding; bf16/fp16: `roundings` roundings of an fp32 result (an ulp of the dtype
    each)."""
    tol = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    tol *= 1 if dtype == torch.float32 else roundings
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

    # The first add of a step gets the stream in the model's dtype (the embeddings) and starts it in fp32.
    want_normed, want_residual = TorchLayerOps.add_norm(x, delta, w, eps)
    got_normed, got_residual = CppLayerOps.add_norm(x.clone(), delta, w, eps)
    assert want_residual.dtype == got_residual.dtype == torch.float32
    assert got_normed.dtype == want_normed.dtype == dtype
    # the add is one fp32 rounding of the same two values: equal to torch's, bit for bit
    torch.testing.assert_close(got_residual, want_residual, rtol=0, atol=0)
    close(got_normed, rms_oracle(want_residual, w, eps), dtype)
    close(got_normed, want_normed, dtype)

    # Later adds: the fp32 stream, updated in place by the C++ form.
    residual = got_residual
    want_normed, want_residual = TorchLayerOps.add_norm(residual.clone(), delta, w, eps)
    got_normed, got_residual = CppLayerOps.add_norm(residual, delta, w, eps)
    assert got_residual is residual  # the stream the next layer adds to
    torch.testing.assert_close(residual, want_residual, rtol=0, atol=0)
    close(got_normed, rms_oracle(want_residual, w, eps), dtype)
    close(got_normed, want_normed, dtype)


@pytest.mark.parametrize("hidden", [576, 37])  # 37: the op's scalar path (not a multiple of 16)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_add_rms_norm_keeps_a_residual_of_the_models_dtype(dtype: torch.dtype, hidden: int) -> None:
    """The op itself also takes the stream in x's dtype: the add rounds to it, as `h = h + delta` does."""
    x = strided(5, hidden, dtype, seed=4, scale=3.0)
    delta = strided(5, hidden, dtype, seed=5)
    w = (torch.rand(hidden, generator=torch.Generator().manual_seed(6)) + 0.5).to(dtype)
    residual = x.clone()
    normed = torch.ops.loragate_cpu.add_rms_norm(residual, delta, w, 1e-5)
    torch.testing.assert_close(residual, x + delta, rtol=0, atol=0)
    close(normed, rms_oracle(x + delta, w, 1e-5), dtype)


@pytest.mark.parametrize("hidden", [576, 37])
@pytest.mark.parametrize(
    ("dtype", "weight_dtype"),
    [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float16),
    ],
)
def test_norms_take_a_weight_of_another_dtype(dtype: torch.dtype, weight_dtype: torch.dtype, hidden: int) -> None:
    """Gemma 3 keeps its norm weights as (1 + w) in fp32 whatever the model's dtype: the result is in x's dtype."""
    eps = 1e-6
    x = strided(9, hidden, dtype, seed=7, scale=3.0)
    delta = strided(9, hidden, dtype, seed=8)
    w = (torch.rand(hidden, generator=torch.Generator().manual_seed(9)) + 0.5).to(weight_dtype)
    for ops in (CppLayerOps, TorchLayerOps):
        normed = ops.norm(x, w, eps)
        assert normed.dtype == dtype
        close(normed, rms_oracle(x, w, eps), dtype)
        normed, residual = ops.add_norm(x.clone(), delta, w, eps)
        assert normed.dtype == dtype and residual.dtype == torch.float32
        close(normed, rms_oracle(x.double() + delta.double(), w, eps), dtype)
    close(CppLayerOps.norm(x, w, eps), TorchLayerOps.norm(x, w, eps), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_torch_norm_matches_hf_qwen3_and_gemma3(dtype: torch.dtype) -> None:
    """HF's Qwen3RMSNorm (Llama's: the normed value rounded before the weight scales it) and Gemma3RMSNorm ((1 + w),
    in fp32, rounded once): the twin computes in fp32 and rounds once, within a rounding of each."""
    hidden, eps = 128, 1e-6
    x = strided(9, hidden, dtype, seed=10, scale=3.0)
    g = torch.Generator().manual_seed(11)
    qwen3 = Qwen3RMSNorm(hidden, eps).to(dtype)
    gemma3 = Gemma3RMSNorm(hidden, eps).to(dtype)
    with torch.no_grad():
        qwen3.weight.copy_(torch.rand(hidden, generator=g) + 0.5)
        gemma3.weight.copy_(torch.rand(hidden, generator=g) - 0.5)
        want_qwen3, want_gemma3 = qwen3(x), gemma3(x)
    close(TorchLayerOps.norm(x, qwen3.weight.detach(), eps), want_qwen3, dtype)
    got_gemma3 = TorchLayerOps.norm(x, 1.0 + gemma3.weight.detach().float(), eps)
    assert got_gemma3.dtype == want_gemma3.dtype == dtype
    close(got_gemma3, want_gemma3, dtype)


# the tails of the activations: e^-x overflows fp32 past 88, underflows below -87; zero; x^3 overflowing fp32
EXTREMES = [0.0, -0.0, 1e-3, -1e-3, 5.0, -5.0, 20.0, -20.0, 87.5, -87.5, 89.0, -89.0, 300.0, -300.0, 1e20, -1e20]
ACTIVATIONS = {
    "silu": (CppLayerOps.silu_mul, TorchLayerOps.silu_mul, F.silu),
    "gelu_tanh": (CppLayerOps.gelu_tanh_mul, TorchLayerOps.gelu_tanh_mul, lambda g: F.gelu(g, approximate="tanh")),
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("inter", [1536, 37])  # 37: the op's scalar path (not a multiple of 16)
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gated_activations_match_the_oracle_and_torch(dtype: torch.dtype, activation: str, inter: int, threads: int):
    torch.set_num_threads(threads)
    cpp, twin, act = ACTIVATIONS[activation]
    gate_up = strided(40, 2 * inter, dtype, seed=3, scale=4.0)
    extremes = torch.tensor(EXTREMES if dtype != torch.float16 else [v for v in EXTREMES if abs(v) < 1e4])
    gate_up[0, : extremes.numel()] = extremes.to(dtype)
    got = cpp(gate_up)
    assert got.dtype == dtype and got.shape == (40, inter)
    gate, up = gate_up.double().split(inter, dim=-1)
    # The activation rounded to the model's dtype before the product, as HF's modeling code computes it: two
    # roundings, the first of which may fall either side of a tie where the op's activation and the oracle's differ
    # in the last fp32 bits.
    want = act(gate).to(dtype).double() * up
    close(got, want, dtype, roundings=2)
    close(got, twin(gate_up), dtype, roundings=2)
    assert torch.isfinite(got).all()


def rope_tables(positions: torch.Tensor, rot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, 1, rot] fp32, the sign of rotate_half folded into sin (engine/model/decoder.py)."""
    cos, sin = hf_rope_tables(positions, rot)
    sin[:, : rot // 2] *= -1
    return cos[:, None], sin[:, None]


def hf_rope_tables(positions: torch.Tensor, rot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, rot] fp32 as HF's rotary embeddings make them (rotate_half's sign not folded in)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2).double() / rot))
    freqs = positions.double()[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float(), emb.sin().float()


def rope_case(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, tokens: int, seed: int):
    block_size, pages = 4, 12
    cache = torch.full((pages, 2, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    slots = torch.randperm(pages * block_size, generator=torch.Generator().manual_seed(seed))[:tokens]
    k_rows = key_rows(slots, block_size)
    plan = AttentionPlan(k_rows, k_rows + block_size, 0, None, None, None, 0, ())
    qkv = strided(tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype, seed=seed, scale=2.0)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(seed + 1))
    return cache, plan, qkv, positions


def rope_oracle(
    heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """heads [T, n, hd] -> float64: RMS-normed over hd times `weight` (if given), then the first rot = cos.shape[-1]
    dims rotated (pairs i and i + rot/2), the rest passed through."""
    x = heads.double()
    if weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    rot = cos.shape[-1]
    part = x[..., :rot]
    return torch.cat([part * cos.double() + torch.roll(part, rot // 2, dims=-1) * sin.double(), x[..., rot:]], -1)


# (heads, kv heads, head_dim, rotated dims): whole heads; partial rotary with both halves a multiple of 16 (the op's
# vector path) and not (its scalar path: 48 and 24 rotated dims), Phi-4-mini's (96 of 128); head dims of 72 (the
# norm's scalar path) and 80 (vector, with normed dims past the rotated ones); the narrowest rotation.
ROPE_SHAPES = [
    (9, 3, 64, 64),
    (4, 1, 32, 32),
    (8, 8, 128, 128),
    (9, 3, 64, 32),
    (9, 3, 64, 48),
    (4, 2, 128, 96),
    (4, 1, 72, 24),
    (3, 1, 80, 32),
    (2, 1, 16, 2),
]


@pytest.mark.parametrize("qk_norm", ["none", "fp32", "model"], ids=["plain", "qk-norm-fp32", "qk-norm-model-dtype"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "rot"), ROPE_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rope_write_kv_matches_the_oracle_and_torch(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, rot: int, qk_norm: str
) -> None:
    tokens, eps = 11, 1e-6
    cache, plan, qkv, positions = rope_case(dtype, num_heads, num_kv_heads, head_dim, tokens, seed=head_dim + rot)
    cos, sin = rope_tables(positions, rot)
    q_norm = k_norm = None
    if qk_norm != "none":
        g = torch.Generator().manual_seed(rot)
        weight_dtype = torch.float32 if qk_norm == "fp32" else dtype
        q_norm = (torch.rand(head_dim, generator=g) + 0.5).to(weight_dtype)
        k_norm = (torch.rand(head_dim, generator=g) + 0.5).to(weight_dtype)
    original = qkv.clone()

    twin_cache = cache.clone()
    want_q, want_k, want_v = TorchLayerOps.rope_write_kv(
        original.clone(), cos.to(dtype), sin.to(dtype), twin_cache, plan, num_heads, q_norm, k_norm, eps
    )
    q, k, v = CppLayerOps.rope_write_kv(qkv, cos, sin, cache, plan, num_heads, q_norm, k_norm, eps)

    heads = original.view(tokens, -1, head_dim)
    exact_q = rope_oracle(heads[:, :num_heads], cos, sin, q_norm, eps)
    exact_k = rope_oracle(heads[:, num_heads : num_heads + num_kv_heads], cos, sin, k_norm, eps)
    close(q, exact_q, dtype)
    close(k, exact_k, dtype)
    if q_norm is None:  # the dims past the rotated ones pass through as they were
        torch.testing.assert_close(q[..., rot:], heads[:, :num_heads, rot:], rtol=0, atol=0)
    torch.testing.assert_close(v, heads[:, num_heads + num_kv_heads :], rtol=0, atol=0)  # not rotated
    torch.testing.assert_close(v, want_v, rtol=0, atol=0)
    for got, want, exact in ((q, want_q, exact_q), (k, want_k, exact_k)):
        if dtype == torch.float32:
            close(got, want, dtype)
        else:  # torch's twin norms, then rotates in the model's dtype (cos/sin rounded too): the op is closer
            assert (got.double() - exact).abs().max() <= (want.double() - exact).abs().max()
    assert q.data_ptr() == qkv.data_ptr()  # rotated in place: q and k are views of qkv

    flat = cache.view(-1, num_kv_heads, head_dim)
    torch.testing.assert_close(flat[plan.k_rows], k, rtol=0, atol=0)
    torch.testing.assert_close(flat[plan.v_rows], v, rtol=0, atol=0)
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[plan.k_rows] = untouched[plan.v_rows] = False
    assert flat[untouched].isnan().all()  # no other row of the layer written
    assert twin_cache.isnan().sum() == cache.isnan().sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_rope_matches_hf_partial_rotary(dtype: torch.dtype) -> None:
    """Phi-3's apply_rotary_pos_emb over the first 96 of 128 dims: the twin computes the same ops (the sign of
    rotate_half folded into sin changes no bit), so it matches to the bit."""
    num_heads, num_kv_heads, head_dim, rot, tokens = 4, 2, 128, 96, 11
    cache, plan, qkv, positions = rope_case(dtype, num_heads, num_kv_heads, head_dim, tokens, seed=3)
    heads = qkv.view(tokens, -1, head_dim)
    hf_cos, hf_sin = hf_rope_tables(positions, rot)
    want_q, want_k = phi3_rope(
        heads[None, :, :num_heads].transpose(1, 2),
        heads[None, :, num_heads : num_heads + num_kv_heads].transpose(1, 2),
        hf_cos[None].to(dtype),
        hf_sin[None].to(dtype),
    )  # [1, heads, T, hd]
    cos, sin = rope_tables(positions, rot)
    q, k, _ = TorchLayerOps.rope_write_kv(qkv, cos.to(dtype), sin.to(dtype), cache, plan, num_heads)
    torch.testing.assert_close(q, want_q[0].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(k, want_k[0].transpose(0, 1), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_rope_with_qk_norm_matches_hf_qwen3(dtype: torch.dtype) -> None:
    """Qwen3's attention: Qwen3RMSNorm on each q and k head, then apply_rotary_pos_emb. HF rounds the normed value in
    bf16 before its weight scales it, the twin once: within two roundings of each other."""
    num_heads, num_kv_heads, head_dim, tokens, eps = 8, 2, 128, 11, 1e-6
    cache, plan, qkv, positions = rope_case(dtype, num_heads, num_kv_heads, head_dim, tokens, seed=4)
    heads = qkv.view(tokens, -1, head_dim)
    g = torch.Generator().manual_seed(5)
    q_norm, k_norm = Qwen3RMSNorm(head_dim, eps).to(dtype), Qwen3RMSNorm(head_dim, eps).to(dtype)
    hf_cos, hf_sin = hf_rope_tables(positions, head_dim)
    with torch.no_grad():
        q_norm.weight.copy_(torch.rand(head_dim, generator=g) + 0.5)
        k_norm.weight.copy_(torch.rand(head_dim, generator=g) + 0.5)
        want_q, want_k = qwen3_rope(
            q_norm(heads[None, :, :num_heads]).transpose(1, 2),
            k_norm(heads[None, :, num_heads : num_heads + num_kv_heads]).transpose(1, 2),
            hf_cos[None].to(dtype),
            hf_sin[None].to(dtype),
        )
    cos, sin = rope_tables(positions, head_dim)
    q, k, _ = TorchLayerOps.rope_write_kv(
        qkv, cos.to(dtype), sin.to(dtype), cache, plan, num_heads, q_norm.weight.detach(), k_norm.weight.detach(), eps
    )
    tol = 2e-6 if dtype == torch.float32 else 2 * 2**-8 * 2.0  # bf16: two ulps of the largest normed value (~2)
    torch.testing.assert_close(q, want_q[0].transpose(0, 1), rtol=tol, atol=tol)
    torch.testing.assert_close(k, want_k[0].transpose(0, 1), rtol=tol, atol=tol)


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
    with pytest.raises(RuntimeError, match=r"weight must be a contiguous CPU \[8\]"):
        CppLayerOps.norm(x, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        CppLayerOps.norm(x, torch.ones(8, dtype=torch.float64), 1e-5)
    with pytest.raises(RuntimeError, match="match residual"):
        CppLayerOps.add_norm(x, torch.randn(2, 8), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="residual must be float32 or of x's dtype"):
        torch.ops.loragate_cpu.add_rms_norm(x.half(), x.bfloat16(), torch.ones(8), 1e-5)
    for op in (CppLayerOps.silu_mul, CppLayerOps.gelu_tanh_mul):
        with pytest.raises(RuntimeError, match="even number"):
            op(torch.randn(3, 7))
        with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
            op(torch.randn(3, 8, dtype=torch.float64))
    cache, plan, qkv, positions = rope_case(torch.float32, 4, 2, 16, 5, seed=8)
    cos, sin = rope_tables(positions, 16)
    with pytest.raises(RuntimeError, match=r"qkv must be \[T"):
        CppLayerOps.rope_write_kv(qkv, cos, sin, cache, plan, 5)
    with pytest.raises(RuntimeError, match="cos and sin"):
        CppLayerOps.rope_write_kv(qkv, cos.double(), sin, cache, plan, 4)
    for rot in (18, 6):  # wider than head_dim; narrower than cos
        wrong_cos, wrong_sin = rope_tables(positions, rot)
        with pytest.raises(RuntimeError, match="cos and sin"):
            CppLayerOps.rope_write_kv(qkv, wrong_cos, sin if rot == 6 else wrong_sin, cache, plan, 4)
    with pytest.raises(RuntimeError, match="cos and sin"):  # an odd width
        CppLayerOps.rope_write_kv(qkv, cos[..., :15].contiguous(), sin[..., :15].contiguous(), cache, plan, 4)
    with pytest.raises(RuntimeError, match="q_norm and k_norm come together"):
        torch.ops.loragate_cpu.rope_write_kv(qkv, cos, sin, cache, plan.k_rows, plan.v_rows, 4, torch.ones(16))
    with pytest.raises(RuntimeError, match=r"k_norm must be a contiguous CPU \[16\]"):
        CppLayerOps.rope_write_kv(qkv, cos, sin, cache, plan, 4, torch.ones(16), torch.ones(15))
