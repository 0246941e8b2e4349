"""Paged-attention decode as a Triton kernel: one new token per sequence, attending over its context in the
paged KV cache (the layout of engine/model/attention.py), for the GPU decode path.

One program per (sequence, kv head) serves all `group = num_heads // num_kv_heads` query heads that share
the kv head (GQA), so each K/V row is read from memory once per step. The program walks the context in tiles
of BLOCK_N positions (a tile may span several pages, or part of one: each position finds its page through the
block table), with an online softmax in fp32 (FlashAttention's running max and sum). A sliding window (Hugging Face's
rule: the query at position n - 1 sees keys p with n - 1 - window < p) starts the walk at the window's first position,
so the positions before it, and their pages, are never read.

Made for CUDA-graph capture: the grid depends only on shapes and the kernel reads `context_lens` itself, so
nothing is read back to the host. Positions at or past a sequence's context length are never loaded (the
tail of its last block and the pages its table's padding names may hold another request's NaN/inf) and
their scores are -inf.

Dtypes: q, the cache and the output share a dtype (fp32, fp16 or bf16); scores, the softmax and the output
accumulate in fp32; probabilities are rounded to the cache's dtype before the product with V (as the torch
path's `_decode_attention` and FlashAttention do); fp32 dots run in IEEE precision (Triton would default them
to tf32). Kernels run compiled for CUDA tensors and under Triton's interpreter for CPU ones
(loragate_kernels/triton/jit.py); interpreted, dot operands are cast to fp32 first: the interpreter multiplies bf16
dots' raw bits (triton issue 11584).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loragate_kernels.triton.jit import cuda_device, device_jit, interpreted

BLOCK_N = 32  # context positions per loop iteration (independent of the cache's block_size)
# tl.dot needs every dimension >= 16 on a GPU, and the query group (num_heads // num_kv_heads) is 1..8 in
# practice: its rows are padded to at least 16 (masked on load and store, zeros in between). The padded rows
# cost tensor-core work only, which decode (bound by reading K/V) has to spare; a broadcast multiply and
# tl.sum instead would hold a [group, BLOCK_N, head_dim] fp32 product in registers (128 per thread for
# group 8, head_dim 128) and spill.
MIN_GROUP_ROWS = 16
_LOG2E = 1.4426950408889634


@device_jit
def _paged_decode_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    qk_scale,
    window,
    group,
    stride_qd,
    stride_qh,
    stride_page,
    stride_kv,
    stride_tok,
    stride_head,
    stride_bt_row,
    stride_bt_col,
    stride_od,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_ROWS: tl.constexpr,
    CAST_FP32: tl.constexpr,
    IEEE: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    ctx_len = tl.load(context_lens_ptr + seq)
    g = tl.arange(0, GROUP_ROWS)
    g_ok = g < group  # padding rows (up to GROUP_ROWS) are neither loaded nor stored
    heads = kv_head * group + g  # int64: the query heads reading this kv head
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qd + heads[:, None] * stride_qh + dims[None, :], mask=g_ok[:, None], other=0.0)
    if CAST_FP32:
        q = q.to(tl.float32)
    m_i = tl.full((GROUP_ROWS,), float("-inf"), dtype=tl.float32)  # running max of the base-2 scores
    l_i = tl.zeros((GROUP_ROWS,), dtype=tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros((GROUP_ROWS, HEAD_DIM), dtype=tl.float32)
    table_row = block_tables_ptr + seq * stride_bt_row
    head_offset = kv_head * stride_head
    # The window's first position (0 without one): tiles run from it, so every position a tile holds is >= it, and
    # every tile holds at least one position < ctx_len, so m_i is finite after the first one.
    first = tl.where(window > 0, tl.maximum(ctx_len - window, 0), 0)
    for start in range(first, ctx_len, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < ctx_len
        # Table entries past ceil(ctx_len / BLOCK_SIZE) are padding: never read.
        page = tl.load(table_row + (pos // BLOCK_SIZE) * stride_bt_col, mask=valid, other=0).to(tl.int64)
        rows = page * stride_page + (pos % BLOCK_SIZE).to(tl.int64) * stride_tok + head_offset  # [BLOCK_N] int64
        k = tl.load(cache_ptr + rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(cache_ptr + stride_kv + rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        if CAST_FP32:
            k = k.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        # -inf, not just the zeroed loads: a masked position must get no weight at all.
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))  # [GROUP_ROWS, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)  # 0 on the first tile (m_i = -inf)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p_v = p.to(v.dtype)  # rounded to the cache's dtype (a no-op for fp32)
        if CAST_FP32:
            p_v = p_v.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            pv = tl.dot(p_v, v, input_precision="ieee")
        else:
            pv = tl.dot(p_v, v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    # ctx_len 0 (e.g. a padding row of a captured batch) gives zeros, not 0/0.
    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    result = acc / l_i[:, None]
    tl.store(
        out_ptr + seq * stride_od + heads[:, None] * stride_oh + dims[None, :],
        result.to(out_ptr.dtype.element_ty),
        mask=g_ok[:, None],
    )


def paged_decode_attention(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    window: int = 0,
) -> torch.Tensor:
    """One-token attention of every decode sequence over its context in one layer's paged KV cache: the
    same result as engine/model/attention.py `_decode_attention`, with no host synchronisation (CUDA-graph
    safe: `scale` and `window` are plain numbers, baked into a captured launch). The new token's K/V must already
    be in the cache.

    Semantics:
        G = num_heads // num_kv_heads; bs = block_size
        scale = hd**-0.5 if scale is None else scale
        for d in range(D):
            n = context_lens[d]                                   # >= 1, includes the new token
            first = max(0, n - window) if window > 0 else 0       # the window (Hugging Face's): keys p > n - 1 - window
            pages = block_tables[d, p // bs] for p in [first, n)  # other entries are never read
            K = layer_cache[pages, 0, p % bs]; V = layer_cache[pages, 1, p % bs]   # [n - first, kvh, hd]
            for h in range(num_heads):
                s = q[d, h].float() @ K[:, h // G].float().T * scale
                out[d, h] = (softmax(s) @ V[:, h // G].float()).to(q.dtype)
        (a row with context_lens[d] == 0 gets zeros)

    Shapes:
        q:             [D, num_heads, hd]                            head dim contiguous
        layer_cache:   [num_pages, 2, block_size, num_kv_heads, hd]  same dtype as q, head dim contiguous
        block_tables:  [D, W] int64 or int32                          W >= ceil(max(context_lens) / bs)
        context_lens:  [D] int64 or int32
        out:           [D, num_heads, hd] or None                     same dtype as q, head dim contiguous
        returns out (a new tensor when None)
    """
    assert window >= 0, f"window {window}: >= 0 (0: none)"
    assert q.dim() == 3 and layer_cache.dim() == 5 and layer_cache.shape[1] == 2, (
        f"q {tuple(q.shape)} must be [D, H, hd], layer_cache {tuple(layer_cache.shape)} [pages, 2, bs, kvh, hd]"
    )
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = layer_cache.shape[2], layer_cache.shape[3]
    assert layer_cache.shape[4] == head_dim, f"head_dim: q {head_dim}, cache {layer_cache.shape[4]}"
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads over {num_kv_heads} kv heads"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"head_dim {head_dim}: a power of two >= 16"
    assert block_size >= 1 and block_size & (block_size - 1) == 0, f"block_size {block_size}: a power of two"
    assert q.dtype == layer_cache.dtype and q.dtype in (torch.float32, torch.float16, torch.bfloat16), (
        f"dtypes: q {q.dtype}, cache {layer_cache.dtype}"
    )
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs, f"block_tables {tuple(block_tables.shape)}"
    assert context_lens.shape == (num_seqs,), f"context_lens {tuple(context_lens.shape)}"
    assert block_tables.dtype in (torch.int64, torch.int32) and context_lens.dtype in (torch.int64, torch.int32)
    assert q.stride(2) == 1 and layer_cache.stride(4) == 1, "q and the cache need a contiguous head dim"
    assert q.device == layer_cache.device == block_tables.device == context_lens.device
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device and out.stride(2) == 1, (
        f"out {tuple(out.shape)} {out.dtype}: must be like q, head dim contiguous"
    )
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    grid = (num_seqs, num_kv_heads)  # shapes only: the same launch for any context lengths
    with cuda_device(q.device):  # Triton launches on the current CUDA device
        _paged_decode_kernel.on(q.device)[grid](
            q,
            layer_cache,
            block_tables,
            context_lens,
            out,
            (head_dim**-0.5 if scale is None else scale) * _LOG2E,
            window,
            group,
            q.stride(0),
            q.stride(1),
            layer_cache.stride(0),
            layer_cache.stride(1),
            layer_cache.stride(2),
            layer_cache.stride(3),
            block_tables.stride(0),
            block_tables.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_SIZE=block_size,
            BLOCK_N=BLOCK_N,
            GROUP_ROWS=max(MIN_GROUP_ROWS, triton.next_power_of_2(group)),
            CAST_FP32=interpreted(q.device),  # the interpreter's bf16 dot is wrong: it gets fp32 operands
            IEEE=q.dtype == torch.float32,  # fp32 dots in IEEE precision, not tf32
        )
    return out
