"""A decoder layer's elementwise ops around its GEMMs, in two interchangeable forms, one per route of the layer seam
(loragate_kernels/backends.py `Backends.layer`, through `LAYER_OPS`): `TorchLayerOps`, plain torch ops (CUDA, and CPUs
where the C++ ops cannot be built; the twin the C++ ops are tested against), and `CppLayerOps`,
loragate_kernels/cpu/layer.cpp's fused ops (one pass over the rows each, fp32 inside, rounded once to the model's
dtype). Both forms give the same results within rounding:

    norm(x, weight, eps)              rms_norm(x) * weight, in x's dtype (the weight of any float dtype: Gemma 3's
                                      (1 + w) stays fp32)
    add_norm(residual, x, weight, eps)  (norm(residual + x) in x's dtype, residual + x in fp32)
    silu_mul(gate_up)                 silu(gate) * up       gate_up [T, 2I] = gate | up -> [T, I]
    gelu_tanh_mul(gate_up)            gelu(gate, approximate="tanh") * up (Gemma's GeGLU)
    rope_write_kv(qkv, cos, sin, layer_cache, plan, num_heads, q_norm=None, k_norm=None, eps=1e-6)
                                      q and k heads RMS-normed over head_dim (times q_norm / k_norm, where given:
                                      Qwen3, Gemma 3), then rotated over their first rot = cos.shape[-1] dims (partial
                                      rotary past them: Phi-4-mini); k and v written into the cache; returns q, k, v
                                      [T, heads, hd] (the C++ form rotates qkv in place and returns views of it)

The residual stream is carried beside the layer's output, as vLLM does, so its add fuses with the next norm. It is
held in fp32 whatever the model's dtype: HF and vLLM keep it in the model's dtype, and in bf16 each of a layer's two
adds then rounds the whole stream to 8 bits of mantissa, the largest single share of a bf16 model's error against its
fp32 self (tests/engine/test_bf16_accuracy.py measures it against HF). The first add_norm of a step gets the stream in
the model's dtype (the embeddings, which upcast exactly) and returns it in fp32; the C++ form updates an fp32
`residual` in place. The normed rows the GEMMs read stay in the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.attention import AttentionPlan, write_kv
from loragate_kernels.backends import Kernel


class TorchLayerOps:
    """The torch form (see the module docstring): in bf16, RoPE and the activations round after each op, as HF's
    modeling code does."""

    rope_dtype: torch.dtype | None = None  # the cos/sin tables in the model's dtype
    # whether a GEMM whose route applies the MLP's activation on its tiles may (its result is this form's, bit for
    # bit: engine/model/cpu_gemm.py PackedLinear `silu_mul`)
    fused_activation = False

    @staticmethod
    def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    @staticmethod
    def add_norm(
        residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual.float() + x  # [T, hidden] fp32: the stream (see the module docstring)
        return rms_norm(residual, weight, eps, x.dtype), residual

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    @staticmethod
    def rope_write_kv(
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_cache: torch.Tensor,
        plan: AttentionPlan,
        num_heads: int,
        q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None,
        eps: float = 1e-6,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (each head RMS-normed first where q_norm and k_norm are given) rotated, and v, each [T, heads, hd];
        k and v written into the cache."""
        num_tokens, head_dim = qkv.shape[0], layer_cache.shape[-1]
        num_kv_heads = layer_cache.shape[-2]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        qk = qkv[:, : q_size + kv_size].view(num_tokens, -1, head_dim)  # [T, H + kvh, hd]: q and k are adjacent
        if q_norm is not None and k_norm is not None:
            qk = torch.cat([rms_norm(qk[:, :num_heads], q_norm, eps), rms_norm(qk[:, num_heads:], k_norm, eps)], 1)
        else:
            assert q_norm is None and k_norm is None, "q_norm and k_norm come together"
        qk = apply_rope(qk, cos, sin)  # one call rotates both
        q, k = qk[:, :num_heads], qk[:, num_heads:]
        v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
        write_kv(layer_cache, k, v, plan)
        return q, k, v


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim, in `dtype` (default x's). One op at every dtype: in bf16
    it computes in fp32 and rounds once, where HF's Llama rounds the normed value before scaling it (within a bf16 ulp
    of each other). Where the dtypes differ (an fp32 residual stream normed for a bf16 model; Gemma 3's (1 + w), kept
    in fp32 as HF computes it) it computes in fp32 and rounds once: F.rms_norm only fuses one dtype."""
    dtype = x.dtype if dtype is None else dtype
    if weight.dtype != x.dtype or dtype != x.dtype:
        return F.rms_norm(x.float(), weight.shape, weight.float(), eps).to(dtype)
    return F.rms_norm(x, weight.shape, weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd], cos/sin [T, 1, rot] with rot <= hd, even -> rotated x (a new tensor): HF's rotate_half over
    the first rot dims of each head (pairs i and i + rot/2), the rest passed through (partial rotary). The sign of
    rotate_half is folded into `sin` (engine/model/decoder.py `RotaryEmbedding`)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + torch.roll(x, shifts=rot // 2, dims=-1) * sin
    part = x[..., :rot]
    return torch.cat([part * cos + torch.roll(part, shifts=rot // 2, dims=-1) * sin, x[..., rot:]], dim=-1)


class CppLayerOps:
    """The C++ form (see the module docstring): each op one pass over the rows, fp32 inside, rounded once; the gated
    activations round the activation to the model's dtype before the product, as HF's modeling code (and
    `TorchLayerOps`) computes act(gate) * up: in bf16, keeping it in fp32 measured no closer to fp32's outputs and
    moved SmolLM2's greedy chat answer off HF's (docs/performance.md, *bf16 against HF's bf16*)."""

    rope_dtype: torch.dtype | None = torch.float32  # the op rotates in fp32 from fp32 tables
    fused_activation = True

    @staticmethod
    def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.ops.loragate_cpu.rms_norm(x, weight, eps)

    @staticmethod
    def add_norm(
        residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual.dtype != torch.float32:  # the embeddings, at the first layer: the stream starts here, in fp32
            residual = residual.float()
        return torch.ops.loragate_cpu.add_rms_norm(residual, x, weight, eps), residual

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.loragate_cpu.silu_mul(gate_up)

    @staticmethod
    def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.loragate_cpu.gelu_tanh_mul(gate_up)

    @staticmethod
    def rope_write_kv(
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_cache: torch.Tensor,
        plan: AttentionPlan,
        num_heads: int,
        q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None,
        eps: float = 1e-6,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        torch.ops.loragate_cpu.rope_write_kv(
            qkv, cos, sin, layer_cache, plan.k_rows, plan.v_rows, num_heads, q_norm, k_norm, eps
        )
        num_tokens, (num_kv_heads, head_dim) = qkv.shape[0], layer_cache.shape[-2:]
        heads = qkv.view(num_tokens, num_heads + 2 * num_kv_heads, head_dim)
        v_start = num_heads + num_kv_heads
        return heads[:, :num_heads], heads[:, num_heads:v_start], heads[:, v_start:]


LayerOps = type[TorchLayerOps] | type[CppLayerOps]
LAYER_OPS: dict[Kernel, LayerOps] = {Kernel.CPP: CppLayerOps, Kernel.TORCH: TorchLayerOps}
