"""A decoder layer's elementwise ops around its GEMMs, in two interchangeable forms, one per route of the layer seam
(loragate_kernels/backends.py `Backends.layer`, through `LAYER_OPS`): `TorchLayerOps`, plain torch ops (CUDA, and CPUs
where the C++ ops cannot be built; the twin the C++ ops are tested against), and `CppLayerOps`,
loragate_kernels/cpu/layer.cpp's fused ops (one pass over the rows each, fp32 inside, rounded once to the model's
dtype).

The residual stream is carried beside the layer's output, as vLLM does, so its add fuses with the next norm:
`add_norm(residual, x, ...)` returns (rms_norm(residual + x), residual + x). The torch form computes exactly what
`h = h + delta; rms_norm(h)` does; the C++ form updates `residual` in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.attention import AttentionPlan, write_kv
from loragate_kernels.backends import Kernel


class TorchLayerOps:
    rope_dtype: torch.dtype | None = None  # the cos/sin tables in the model's dtype
    # whether a GEMM whose route applies the MLP's activation on its tiles may (its result is this form's, bit for
    # bit: engine/model/cpu_gemm.py PackedLinear `silu_mul`)
    fused_activation = False

    @staticmethod
    def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # One op at every dtype: in bf16 it computes in fp32 and rounds once, where HF rounds the normed value
        # before scaling it (within a bf16 ulp of each other).
        return F.rms_norm(x, weight.shape, weight, eps)

    @staticmethod
    def add_norm(
        residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return F.rms_norm(residual, weight.shape, weight, eps), residual

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def rope_write_kv(
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_cache: torch.Tensor,
        plan: AttentionPlan,
        num_heads: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k rotated and v, each [T, heads, hd]; k and v written into the cache."""
        num_tokens, head_dim = qkv.shape[0], layer_cache.shape[-1]
        num_kv_heads = layer_cache.shape[-2]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        # q and k are adjacent in qkv, so one RoPE call rotates both: [T, H + kvh, hd].
        qk = apply_rope(qkv[:, : q_size + kv_size].view(num_tokens, -1, head_dim), cos, sin)
        q, k = qk[:, :num_heads], qk[:, num_heads:]
        v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
        write_kv(layer_cache, k, v, plan)
        return q, k, v


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd], cos/sin [T, 1, hd] -> rotated x (a new tensor). The sign of rotate_half is folded into
    `sin` (engine/model/llama.py `RotaryEmbedding`)."""
    return x * cos + torch.roll(x, shifts=x.shape[-1] // 2, dims=-1) * sin


class CppLayerOps:
    rope_dtype: torch.dtype | None = torch.float32  # the op rotates in fp32 from fp32 tables
    fused_activation = True

    @staticmethod
    def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.ops.loragate_cpu.rms_norm(x, weight, eps)

    @staticmethod
    def add_norm(
        residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.loragate_cpu.add_rms_norm(residual, x, weight, eps), residual

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.loragate_cpu.silu_mul(gate_up)

    @staticmethod
    def rope_write_kv(
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_cache: torch.Tensor,
        plan: AttentionPlan,
        num_heads: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        torch.ops.loragate_cpu.rope_write_kv(qkv, cos, sin, layer_cache, plan.k_rows, plan.v_rows, num_heads)
        num_tokens, (num_kv_heads, head_dim) = qkv.shape[0], layer_cache.shape[-2:]
        heads = qkv.view(num_tokens, num_heads + 2 * num_kv_heads, head_dim)
        v_start = num_heads + num_kv_heads
        return heads[:, :num_heads], heads[:, num_heads:v_start], heads[:, v_start:]


LayerOps = type[TorchLayerOps] | type[CppLayerOps]
LAYER_OPS: dict[Kernel, LayerOps] = {Kernel.CPP: CppLayerOps, Kernel.TORCH: TorchLayerOps}
