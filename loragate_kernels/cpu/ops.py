"""The CPU's C++ ops as Python functions: each wraps one `torch.ops.loragate_cpu.*` op (built by
loragate_kernels/cpu/build.py) and documents its semantics and shapes. The GEMMs are called by engine/model/cpu_gemm.py
directly (`panel_linear`, `skinny_linear`, `amx_linear` and their `*_lora` twins, which add a LoRA group's deltas to
their output in the same call and save a step 120 calls into the dispatcher).

Why C++: a step of 32 decodes over 8 adapters is, on SmolLM2, ~2,600 tiny matmuls per step as torch ops
(`lora_sgmv_group`, the twin in loragate_kernels/reference.py), and ~330 batched ones over per-step weight copies
padded to the step's largest rank (engine/lora/stacks.py). Either way the cost is dispatch, conversions and the
padded copies' bytes, not FLOPs. The LoRA op reads each adapter's weights once, unpadded, in the model's dtype (half
of fp32's bytes in bf16), with fp32 products and sums. Decode attention in torch gathers every sequence's context
into a batch-shaped copy per layer, then runs five ops over it; the attention op reads K and V through the block
tables where they lie. Around the GEMMs, a layer in torch is ~20 small ops (RMSNorm alone is six on a CPU), each a
dispatch and a tensor; the layer ops make it five passes over the rows (engine/model/layer_ops.py).
`python bench/lora_cost.py` and `python bench/step_profile.py` measure both in a W1 step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from loragate_kernels.triton.sgmv import GroupTables


def lora_sgmv_group_cpu(
    y: torch.Tensor,
    x: torch.Tensor,
    segments: torch.Tensor,
    pool: torch.Tensor,
    block: torch.Tensor,
    out_cols: Sequence[int],
) -> None:
    """y += the group's LoRA deltas for every segment, in place: loragate_kernels/reference.py `lora_sgmv_group`'s
    result (the oracle; sums in another order), with the index tables as one block of the device tier's table.

    Shapes:
        y:        [T, out_cols[-1]]  columns contiguous, rows any stride; fp32, bf16 or fp16 like x and pool
        x:        [T, in_features]   columns contiguous
        segments: [2 S + 1] int64    the S + 1 segment starts, then the S slots (segments with no rows, or a
                                     rank-0 slot, are skipped)
        pool:     [N]                one layer's pool, contiguous
        block:    [2 + 3 M, slots]   int64, contiguous: a_offsets, ranks[M], b_offsets[M], h_cols[M], rank_total
                                     (`pack_tables`; M >= the group's modules, which use the first rows)
        out_cols: [modules + 1]      the modules' column boundaries in y
    Raises RuntimeError on inconsistent arguments (a table entry past the pool, a slot out of range).
    """
    torch.ops.loragate_cpu.lora_sgmv_group(y, x, segments, pool, block, out_cols)


def dora_scale_group_cpu(
    y: torch.Tensor,
    segments: torch.Tensor,
    pool: torch.Tensor,
    g_offsets: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> None:
    """DoRA's rescale of a group's rows in place, y[rows] = g * y[rows] + (1 - g) * bias for each segment whose slot
    has row scales g in the pool: loragate_kernels/reference.py `dora_scale_group`'s result (the oracle), in one call.

    Shapes:
        y:         [T, out]      columns contiguous, rows any stride; fp32, bf16 or fp16 like pool
        segments:  [2 S + 1]     int64: the S + 1 segment starts, then the S slots (`lora_sgmv_group_cpu`'s)
        pool:      [N]           one layer's pool, contiguous
        g_offsets: [slots]       int64, contiguous: where each slot's g [out] starts in the pool; -1: none
        bias:      [out] or None any float dtype
    Raises RuntimeError on inconsistent arguments (a slot out of range, scales past the pool), before writing.
    """
    torch.ops.loragate_cpu.dora_scale_group(y, segments, pool, g_offsets, bias)


def pack_tables(tables: GroupTables, modules: int | None = None) -> torch.Tensor:
    """A group's tables as the op's block [2 + 3 M, slots] int64 (M = `modules`, default the tables' own)."""
    m = tables.ranks.shape[0] if modules is None else modules
    block = torch.zeros(2 + 3 * m, tables.a_offsets.numel(), dtype=torch.int64)
    n = tables.ranks.shape[0]
    block[0] = tables.a_offsets
    block[1 : 1 + n] = tables.ranks
    block[1 + m : 1 + m + n] = tables.b_offsets
    block[1 + 2 * m : 1 + 2 * m + n] = tables.h_cols
    block[1 + 3 * m] = tables.rank_total
    return block


def paged_decode_attention_cpu(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float | None = None,
    window: int = 0,
) -> torch.Tensor:
    """One-token attention of every decode sequence over its context in one layer's paged KV cache: the semantics
    of loragate_kernels/triton/paged_attention.py `paged_decode_attention` (the Triton kernel; the new token's K/V
    must already be in the cache), on CPU tensors. `scale` multiplies the scores (None: hd**-0.5); `window` > 0
    keeps a row with context n to positions [max(0, n - window), n) (Hugging Face's sliding window), and the pages
    wholly before that are never read; 0 attends the whole context.

    Shapes:
        q:             [D, num_heads, hd]                             head dim contiguous
        layer_cache:   [num_pages, 2, block_size, num_kv_heads, hd]   q's dtype (fp32, bf16 or fp16)
        block_tables:  [D, W] int64, W >= ceil(max(context_lens) / block_size); entries outside a row's window unread
        context_lens:  [D] int64 (a row with 0 gets zeros)
        returns        [D, num_heads, hd], a new tensor
    Raises RuntimeError on a table entry (that a row reads) that is not a page, a length past its table, or a
    negative window.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return torch.ops.loragate_cpu.paged_decode_attention(q, layer_cache, block_tables, context_lens, scale, window)


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, n] (columns contiguous) -> x * rsqrt(mean(x^2) + eps) * weight, a new [T, n]; fp32 inside, rounded
    once to x's dtype. The weight may have another dtype than x (Gemma's (1 + w) norms are kept in fp32)."""
    return torch.ops.loragate_cpu.rms_norm(x, weight, eps)


def add_rms_norm_cpu(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x in place, then `rms_norm_cpu(residual, ...)` in x's dtype: the residual stream's add fused with
    the next norm. `residual` is fp32 (the stream the model keeps: engine/model/layer_ops.py) or x's dtype; both
    [T, n]."""
    return torch.ops.loragate_cpu.add_rms_norm(residual, x, weight, eps)


def silu_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate | up) -> silu(gate) * up, a new [T, I]; fp32 inside, rounded once."""
    return torch.ops.loragate_cpu.silu_mul(gate_up)


def gelu_tanh_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate | up) -> gelu_tanh(gate) * up (GeGLU, Gemma's MLP), a new [T, I]; fp32 inside, rounded
    once."""
    return torch.ops.loragate_cpu.gelu_tanh_mul(gate_up)


def rope_write_kv_cpu(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layer_cache: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    num_heads: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> None:
    """Norm (when q_norm and k_norm are given: an RMSNorm over head_dim of each head, Qwen3's and Gemma 3's) and
    rotate qkv's q and k heads in place (on each head's first rot dims: x * cos + roll(x, rot/2) * sin,
    engine/model/decoder.py `RotaryEmbedding`; fp32 inside, rounded once), then write each token's k and v into the
    cache rows k_rows / v_rows.

    Shapes:
        qkv:          [T, (num_heads + 2 * kvh) * hd]  q | k | v, columns contiguous
        cos, sin:     [T, 1, rot] or [T, rot] float32, contiguous, rot even and <= hd (partial rotary: rot < hd)
        layer_cache:  [num_pages, 2, block_size, kvh, hd] contiguous, qkv's dtype
        k_rows, v_rows: [T] int64 rows of the cache viewed as [rows, kvh, hd] (engine/model/attention.py `key_rows`)
        q_norm, k_norm: [hd], any float dtype
    Raises RuntimeError on a row outside the cache (checked before anything is written).
    """
    torch.ops.loragate_cpu.rope_write_kv(qkv, cos, sin, layer_cache, k_rows, v_rows, num_heads, q_norm, k_norm, eps)


def greedy_rows_cpu(logits: torch.Tensor, banned: torch.Tensor, non_finite: int, no_token: int) -> list[int]:
    """Each row's first maximal index over the columns not in `banned`, in one pass: `non_finite` for a row with
    a NaN or infinite logit (banned columns included), `no_token` where every column is banned.

    Shapes:
        logits: [B, V]  fp32, bf16 or fp16, columns contiguous, rows any stride
        banned: [n]     int64 column ids within [0, V) (duplicates allowed); empty for none
    Raises RuntimeError on a banned id outside the vocabulary.
    """
    return torch.ops.loragate_cpu.greedy_rows(logits, banned, non_finite, no_token).tolist()
