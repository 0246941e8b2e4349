"""Attention over a paged KV cache for a flat batch of tokens from many sequences.

KV cache layout, one tensor for the whole model, which is also the unified page pool (S-LoRA):
    kv_cache: [num_layers, num_pages, 2, block_size, num_kv_heads, head_dim]   (2 = key, value)
Per layer, a page is one contiguous run of `2 * block_size * num_kv_heads * head_dim` elements; a page
holds either one KV block or part of an adapter's weights (engine/lora/device_tier.py), so an adapter given a run of
consecutive pages owns one contiguous region per layer.
A token at position p of a sequence lives in block `block_table[p // block_size]` at offset
`p % block_size`; its logical slot is `block_id * block_size + offset`. In a layer's cache viewed as rows
of [kvh, hd], its key sits at row `2 * block_id * block_size + offset` and its value `block_size` rows on.

The flat batch puts the decode tokens (sequences computing exactly one new token) first, then the
prefill chunks (sequences computing several tokens, possibly a chunk of a longer prompt).

`plan_attention` turns a step's metadata into gather indices and masks once; `paged_attention` then
runs one layer (write K/V, attend) with that plan.

Three ways to attend for decodes, the routes of the attention seam (loragate_kernels/backends.py `Backends.attention`):
"cpp" (CPU, where the C++ ops built) runs loragate_kernels/cpu/attention.cpp and "triton" (CUDA) runs
loragate_kernels/triton/paged_attention.py, both reading K/V through the block tables with no copy (the Triton kernel
needs nothing from the host: CUDA graphs capture it); "torch" (a CPU without the C++ ops) gathers each decode's context
into [D, kv_heads, max_ctx, head_dim] once per layer and attends with grouped matmuls. Prefill chunks go
through SDPA with 4-D inputs (torch's fused kernels only take those), causal from the lower right for a
chunk after cached context; a step's fresh prompts (no cached context) go through one SDPA call together, right-padded
to one length (`FreshBatch`).

A layer may attend through a sliding window (Gemma 3's local layers, Mistral, Qwen2), with Hugging Face's rule: the
query at position p attends keys k with p - window < k <= p, `window` keys at most. A model with windowed and global
layers makes one plan per distinct window a step (`plan_attention`'s `shared` lets the second reuse the first's
window-independent work). Each route skips what lies before the window rather than masking it: the kernels start at
the window's first position (never reading the pages before it), the torch decode path gathers the window alone, a
chunk after cached context gathers the keys its first query's window reaches; boolean masks (causal and window
together) replace SDPA's causal flag only where a window cuts into a context. Where the window reaches past every
context nothing changes, not even a mask. The softmax scale is the plan's too (Gemma 3's query_pre_attn_scalar**-0.5;
head_dim**-0.5 by default).
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from loragate_kernels.backends import Kernel

if TYPE_CHECKING:
    from engine.model.config import ModelConfig


# The step's metadata and plans are made every step: plain (not frozen) dataclasses, whose __init__ is several
# times faster.


@dataclass(slots=True)
class PrefillSeq:
    """A sequence computing `query_len` tokens this step: flat rows [token_start, token_start+query_len).

    Those tokens sit at positions [context_len - query_len, context_len); every earlier position
    already has K/V in the cache, reachable through `block_table`.
    """

    token_start: int
    query_len: int
    context_len: int
    block_table: torch.Tensor  # [ceil(context_len / block_size)] int64


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot where each token's K/V is written
    num_decode_tokens: int  # rows [0, num_decode_tokens) are decodes, one per sequence
    decode_block_tables: torch.Tensor  # [num_decode_tokens, max_blocks] int64, padded with 0
    decode_context_lens: torch.Tensor  # [num_decode_tokens] int64: tokens in context incl. the new one
    prefills: tuple[PrefillSeq, ...]  # the remaining rows, in order
    # the longest decode context: the runner knows it; reading it from the tensor would wait for the GPU
    max_decode_context_len: int


@dataclass(slots=True)
class PrefillPlan:
    """One prefill sequence's gather indices, shared by every layer of a step."""

    token_start: int
    query_len: int
    # [keys] cache rows of the keys (values) of positions [context_len - keys, context_len): the whole context, or
    # where a window cuts into it, the positions its first query's window reaches; None when the chunk is the whole
    # context (a fresh prompt): then keys and values come straight from this step's rows.
    context_k: torch.Tensor | None
    context_v: torch.Tensor | None
    # [query_len, keys] bool, True where a query attends a key (causal and the window), only where a window cuts
    # into the context; None: causal (from the lower right after cached context)
    mask: torch.Tensor | None = None


@dataclass(slots=True)
class FreshBatch:
    """The step's fresh prompts (prefill chunks with no cached context) attended as one batch: [B, max_len] with each
    prompt's rows at the front of its row of the batch. Causal attention lets right padding alone: a query at
    position i reads keys 0..i, all of its own prompt, so the padded positions change no real row."""

    members: tuple[int, ...]  # indices into AttentionPlan.prefills
    max_len: int
    # (src, dst), [sum of lengths] int64 each: the members' rows (relative to the first prefill row) and where they sit
    # in the batch viewed as [B * max_len]; None when the members are consecutive rows of one length (the batch is a
    # view of them)
    padding: tuple[torch.Tensor, torch.Tensor] | None
    # [max_len, max_len] bool, causal and the window, where a window is shorter than the longest member; None: causal.
    # (The window keeps a real row to real keys too: a query at i reads keys in (i - window, i].)
    mask: torch.Tensor | None = None


# Fresh prompts are batched when the padded batch computes at most this many times the attention of the prompts
# alone (causal attention costs ~length^2). One SDPA call instead of one per prompt: 1.1-2.1x faster alone for 2-8
# prompts of 64-256 tokens, and the attention of a 512-token step of 4 prompts 1.15-1.2x faster, on a 2-core CPU
# (fp32 and bf16; docs/performance.md).
FRESH_BATCH_WASTE = 2.0

# On the C++ path, a step whose prompt chunks all have contexts of at most this many tokens attends every row, prompt
# tokens included, in one call of the paged decode kernel (loragate_kernels/cpu/attention.cpp): a prompt token at
# position p is a decode row with context p + 1, its K/V already in the cache, so nothing is padded or copied; in fp32
# the kernel takes a prompt's rows 16 at a time, one a lane. Each row reads its whole context where SDPA's flash kernel
# tiles it, so the kernel's lead over SDPA shrinks as contexts grow: it is ahead up to 1024 tokens and behind at 2048
# (`python bench/prompt_attention.py`; docs/performance.md, *Attention*, has the figures). Longer contexts keep SDPA.
# Under a sliding window a row reads the window's keys alone, so what counts is the context or the window, the shorter.
PAGED_PREFILL_MAX_CONTEXT = 1024


@dataclass(slots=True)
class AttentionPlan:
    """Everything attention needs for one step, derived once from AttentionMetadata (not per layer)."""

    k_rows: torch.Tensor  # [num_tokens] int64: cache rows ([kvh, hd] each) for this step's keys
    v_rows: torch.Tensor  # [num_tokens] int64: ... and values
    num_decode_tokens: int
    # [D * kvh * max_ctx] int64: rows of the cache viewed as [rows * kvh, hd] holding each decode
    # sequence's keys (values) at positions [first, first + max_ctx), ordered [D, kvh, max_ctx]: one gather
    # yields the [D, kvh, ctx, hd] layout the grouped matmuls want (first: the window's first position, else 0).
    decode_k_rows: torch.Tensor | None
    decode_v_rows: torch.Tensor | None
    decode_bias: torch.Tensor | None  # [D, 1, 1, max_ctx]: 0 where first + i < context_len, else -inf
    max_decode_ctx: int  # the decode gather's width: the longest decode context, or the window where shorter
    prefills: tuple[PrefillPlan, ...]
    # the "triton" and "cpp" decode paths read the metadata's block tables and lengths as they are (no gather rows)
    decode_block_tables: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None
    decode_kernel: Kernel = Kernel.TORCH  # the attention route (loragate_kernels/backends.py)
    fresh: FreshBatch | None = None  # fresh prompts attended in one batch (`plan_fresh_batch`)
    # the leading rows the paged kernel attends through decode_block_tables / decode_context_lens: the decodes, or
    # every row of the step (PAGED_PREFILL_MAX_CONTEXT)
    paged_rows: int = 0
    # the sliding window as asked (0: none), whatever this step's contexts: the kernels take it as it is (a CUDA
    # graph replays their launch with other lengths); the torch paths mask only where it cuts into a context
    window: int = 0
    scale: float | None = None  # the softmax scale; None: head_dim**-0.5


def plan_attention(
    attn: AttentionMetadata,
    block_size: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    kernel: Kernel,
    window: int | None = None,
    scale: float | None = None,
    shared: AttentionPlan | None = None,
) -> AttentionPlan:
    """Precompute gather indices and masks for a step; `dtype` is the dtype of the attention scores, `kernel` the
    attention route, `window` the layers' sliding window (None: full causal attention), `scale` the softmax scale
    (None: head_dim**-0.5). `shared`: a plan of the same step (for another window) whose window-independent parts
    this one reuses rather than computing them again: the K/V write rows, the C++ route's per-row block tables, the
    chunks that neither window cuts into."""
    if window is not None and window < 1:
        raise ValueError(f"a sliding window holds at least one position, not {window}")
    span = window or 0
    decode_k = decode_v = decode_bias = tables = lens = None
    max_ctx = attn.max_decode_context_len
    if shared is None:
        k_rows = key_rows(attn.slot_mapping, block_size)
        v_rows = k_rows + block_size
    else:
        assert shared.k_rows.shape == attn.slot_mapping.shape, "a shared plan must be of the same step"
        k_rows, v_rows = shared.k_rows, shared.v_rows
    if (
        kernel is Kernel.CPP
        and attn.prefills
        and all(_reach(seq.context_len, span) <= PAGED_PREFILL_MAX_CONTEXT for seq in attn.prefills)
    ):
        rows = attn.slot_mapping.numel()
        if shared is not None and shared.paged_rows == rows and shared.decode_block_tables is not None:
            tables, lens = shared.decode_block_tables, shared.decode_context_lens
        else:
            tables, lens = _paged_rows(attn)
        return AttentionPlan(
            k_rows,
            v_rows,
            attn.num_decode_tokens,
            None,
            None,
            None,
            max_ctx,
            (),
            tables,
            lens,
            kernel,
            None,
            rows,
            span,
            scale,
        )
    if attn.num_decode_tokens > 0:
        if kernel is not Kernel.TORCH:
            tables, lens = attn.decode_block_tables, attn.decode_context_lens
        else:
            decode_k, decode_bias, max_ctx = _plan_decodes(attn, block_size, num_kv_heads, max_ctx, dtype, span)
            decode_v = decode_k + block_size * num_kv_heads
    device = attn.slot_mapping.device
    band = _fresh_band(attn.prefills, span, device)
    reuse = shared.prefills if shared is not None and len(shared.prefills) == len(attn.prefills) else None
    prefills = []
    next_row = attn.num_decode_tokens
    for i, seq in enumerate(attn.prefills):
        assert seq.token_start == next_row and 0 < seq.query_len <= seq.context_len
        next_row += seq.query_len
        if reuse is not None and reuse[i].mask is None and _reach(seq.context_len, span) == seq.context_len:
            prefills.append(reuse[i])  # neither plan's window cuts into this chunk: the same plan
        else:
            prefills.append(_plan_prefill(seq, block_size, span, band))
    assert next_row == attn.slot_mapping.numel(), "decode rows and prefill chunks must tile the batch"
    return AttentionPlan(
        k_rows,
        v_rows,
        attn.num_decode_tokens,
        decode_k,
        decode_v,
        decode_bias,
        max_ctx,
        tuple(prefills),
        tables,
        lens,
        kernel,
        plan_fresh_batch(attn.prefills, attn.num_decode_tokens, device, band),
        attn.num_decode_tokens if tables is not None else 0,
        span,
        scale,
    )


def _reach(context_len: int, window: int) -> int:
    """How many keys the last query of a context of `context_len` reads under `window` (0: none)."""
    return min(context_len, window) if window else context_len


def window_mask(
    query_first: int, queries: int, key_first: int, keys: int, window: int, device: torch.device
) -> torch.Tensor:
    """[queries, keys] bool, True where the query at position query_first + i attends the key at key_first + j:
    causal and Hugging Face's sliding window (query_pos - window < key_pos <= query_pos)."""
    query_pos = torch.arange(query_first, query_first + queries, device=device)[:, None]
    key_pos = torch.arange(key_first, key_first + keys, device=device)
    return (key_pos <= query_pos) & (key_pos > query_pos - window)


def _fresh_band(prefills: tuple[PrefillSeq, ...], window: int, device: torch.device) -> torch.Tensor | None:
    """The [L, L] window mask of the step's longest fresh prompt (L tokens), whose top-left [n, n] is a shorter fresh
    prompt's; None where the window reaches across every fresh prompt."""
    longest = max((seq.query_len for seq in prefills if seq.query_len == seq.context_len), default=0)
    if not window or longest <= window:
        return None
    return window_mask(0, longest, 0, longest, window, device)


def _paged_rows(attn: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables [T, W] and context lengths [T] for every row of the step, as the paged decode kernel reads them:
    a decode row's own, and for a prompt token at position p its sequence's table with context p + 1."""
    num_rows, decodes = attn.slot_mapping.numel(), attn.num_decode_tokens
    next_row = decodes
    for seq in attn.prefills:
        assert seq.token_start == next_row and 0 < seq.query_len <= seq.context_len
        next_row += seq.query_len
    assert next_row == num_rows, "decode rows and prefill chunks must tile the batch"
    width = max([seq.block_table.numel() for seq in attn.prefills] + [attn.decode_block_tables.shape[1]])
    device = attn.slot_mapping.device
    tables = torch.zeros(num_rows, width, dtype=torch.int64, device=device)
    tables[:decodes, : attn.decode_block_tables.shape[1]] = attn.decode_block_tables[:decodes]
    lens = [attn.decode_context_lens[:decodes]]
    for seq in attn.prefills:
        tables[seq.token_start : seq.token_start + seq.query_len, : seq.block_table.numel()] = seq.block_table
        first = seq.context_len - seq.query_len + 1
        lens.append(torch.arange(first, first + seq.query_len, device=device))
    return tables, torch.cat(lens)


def plan_fresh_batch(
    prefills: tuple[PrefillSeq, ...], first_row: int, device: torch.device, band: torch.Tensor | None = None
) -> FreshBatch | None:
    """The batch of the step's fresh prompts (`FreshBatch`), or None where there are fewer than two or padding
    them to one length would waste more than FRESH_BATCH_WASTE. `band`: `_fresh_band`'s mask of the longest fresh
    prompt, where a window cuts into it (the batch's mask then)."""
    members = [i for i, seq in enumerate(prefills) if seq.query_len == seq.context_len]
    if len(members) < 2:
        return None
    lengths = [prefills[i].query_len for i in members]
    max_len = max(lengths)
    if len(members) * max_len**2 > FRESH_BATCH_WASTE * sum(n * n for n in lengths):
        return None
    starts = [prefills[i].token_start - first_row for i in members]
    dense = min(lengths) == max_len and all(b - a == max_len for a, b in pairwise(starts))
    assert band is None or band.shape[0] == max_len
    if dense:
        return FreshBatch(tuple(members), max_len, None, band)
    src = torch.cat([torch.arange(a, a + n) for a, n in zip(starts, lengths, strict=True)])
    dst = torch.cat([torch.arange(b * max_len, b * max_len + n) for b, n in enumerate(lengths)])
    return FreshBatch(tuple(members), max_len, (src.to(device), dst.to(device)), band)


def key_rows(slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """Logical slots (block * block_size + offset) -> key rows of a layer's [rows, kvh, hd] cache view."""
    return slots + (slots // block_size) * block_size


def _plan_decodes(
    attn: AttentionMetadata, block_size: int, num_kv_heads: int, max_ctx: int, dtype: torch.dtype, window: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Cache rows [D * kvh * width] of every decode's positions [first, first + width), the padding bias, and the
    width: max_ctx and first 0, or under a window shorter than max_ctx, the window and its first position."""
    lens = attn.decode_context_lens  # [D]
    tables = attn.decode_block_tables  # [D, >= ceil(max_ctx / block_size)]
    # Positions past a sequence's context_len would read padding (block 0) or the stale tail of its last
    # block, which may hold another request's NaN/inf: they read the first position gathered instead (its own
    # position 0, or its window's first), and the bias masks them out (0 * finite = 0, where 0 * NaN would poison
    # this row).
    if window and window < max_ctx:  # the window alone: positions first + [0, window), first = max(0, len - window)
        width = window
        pos = (lens - window).clamp(min=0)[:, None] + torch.arange(window, device=lens.device)  # [D, window]
        valid = pos < lens[:, None]  # (positions stay below max_ctx: inside the table)
        slots = tables.gather(1, pos // block_size) * block_size + pos % block_size  # [D, window]
        slots = torch.where(valid, slots, slots[:, :1])
    else:
        width = max_ctx
        pos = torch.arange(max_ctx, device=lens.device)  # [max_ctx]
        valid = pos < lens[:, None]
        slots = tables[:, pos // block_size] * block_size + pos % block_size  # [D, max_ctx]
        slots = torch.where(valid, slots, tables[:, :1] * block_size)
    heads = torch.arange(num_kv_heads, device=lens.device)
    rows = key_rows(slots, block_size)[:, None, :] * num_kv_heads + heads[None, :, None]
    rows = rows.reshape(-1)  # [D * kvh * width]
    bias = torch.zeros(lens.numel(), 1, 1, width, dtype=dtype, device=lens.device)
    bias.masked_fill_(~valid[:, None, None, :], float("-inf"))
    return rows, bias, width


def _plan_prefill(seq: PrefillSeq, block_size: int, window: int, band: torch.Tensor | None) -> PrefillPlan:
    """One chunk's gather rows, and its mask where `window` cuts into its context (`band`: the step's fresh-prompt
    mask, `_fresh_band`)."""
    cut = _reach(seq.context_len, window) < seq.context_len
    if seq.query_len == seq.context_len:  # nothing cached before this chunk
        mask = band[: seq.query_len, : seq.query_len] if cut and band is not None else None
        return PrefillPlan(seq.token_start, seq.query_len, None, None, mask)
    query_first = seq.context_len - seq.query_len
    key_first = max(0, query_first - window + 1) if cut else 0  # the first query's window's first key
    device = seq.block_table.device
    pos = torch.arange(key_first, seq.context_len, device=device)  # [keys]
    rows = key_rows(seq.block_table[pos // block_size] * block_size + pos % block_size, block_size)
    mask = window_mask(query_first, seq.query_len, key_first, pos.numel(), window, device) if cut else None
    return PrefillPlan(seq.token_start, seq.query_len, rows, rows + block_size, mask)


def write_kv(layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan) -> None:
    """cache.view(-1, kvh, hd)[plan.k_rows] = k; cache.view(-1, kvh, hd)[plan.v_rows] = v (k, v: [T, kvh, hd])."""
    flat_cache = layer_cache.view(-1, *layer_cache.shape[-2:])  # [rows, kvh, hd]
    flat_cache.index_copy_(0, plan.k_rows, k)
    flat_cache.index_copy_(0, plan.v_rows, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_cache: torch.Tensor,
    plan: AttentionPlan,
    kv_written: bool = False,
) -> torch.Tensor:
    """Write this step's K/V into one layer's cache (`write_kv`, unless the caller has: `kv_written`), then attend
    over each sequence's context.

    Semantics:
        scale = plan.scale if plan.scale is not None else hd**-0.5
        for each sequence: out[rows] = softmax(q[rows] @ K_ctx.T * scale + mask) @ V_ctx
        where mask lets the query at position p see keys k <= p, and with plan.window > 0 only those with
        p - plan.window < k; query head h reads kv head h // (num_heads // num_kv_heads) (GQA).
    Shapes:
        q: [T, num_heads, hd]; k, v: [T, num_kv_heads, hd]
        layer_cache: [num_pages, 2, block_size, num_kv_heads, hd]
        returns [T, num_heads, hd]
    """
    if not kv_written:
        write_kv(layer_cache, k, v, plan)
    flat_cache = layer_cache.view(-1, *layer_cache.shape[-2:])  # [rows, kvh, hd]
    parts = []
    if plan.decode_block_tables is not None and plan.decode_context_lens is not None:
        if plan.decode_kernel is Kernel.CPP:
            from loragate_kernels.cpu.ops import paged_decode_attention_cpu as decode
        else:
            from loragate_kernels.triton.paged_attention import paged_decode_attention as decode

        tables, lens = plan.decode_block_tables, plan.decode_context_lens
        parts.append(decode(q[: plan.paged_rows], layer_cache, tables, lens, scale=plan.scale, window=plan.window))
    elif plan.num_decode_tokens > 0:
        parts.append(_decode_attention(q[: plan.num_decode_tokens], flat_cache, plan))
    if plan.fresh is None:
        for seq in plan.prefills:
            rows = slice(seq.token_start, seq.token_start + seq.query_len)
            parts.append(_prefill_attention(q[rows], k[rows], v[rows], flat_cache, seq, plan.scale))
    else:
        parts.append(_prefills_with_batch(q, k, v, flat_cache, plan))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _prefills_with_batch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flat_cache: torch.Tensor, plan: AttentionPlan
) -> torch.Tensor:
    """Every prefill row's output, [P, H, hd]: the fresh prompts in one SDPA call (`FreshBatch`), the other chunks
    one by one."""
    fresh = plan.fresh
    assert fresh is not None
    first = plan.num_decode_tokens
    batch, length = len(fresh.members), fresh.max_len
    start = plan.prefills[fresh.members[0]].token_start
    if fresh.padding is None:  # consecutive rows of one length: the batch is a view
        qb, kb, vb = (t[start : start + batch * length].unflatten(0, (batch, length)) for t in (q, k, v))
    else:
        qb, kb, vb = (_padded(t[first:], *fresh.padding, batch, length) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        qb.transpose(1, 2),
        kb.transpose(1, 2),
        vb.transpose(1, 2),
        attn_mask=fresh.mask,
        is_causal=fresh.mask is None,
        scale=plan.scale,
        enable_gqa=True,
    )  # [B, H, L, hd]
    rows = out.transpose(1, 2).flatten(0, 1)  # [B * L, H, hd]
    if fresh.padding is None and batch == len(plan.prefills):
        return rows
    result = q.new_empty(q.shape[0] - first, *q.shape[1:])
    if fresh.padding is None:
        result[start - first : start - first + batch * length] = rows
    else:
        src, dst = fresh.padding
        result.index_copy_(0, src, rows.index_select(0, dst))
    batched = set(fresh.members)
    for i, seq in enumerate(plan.prefills):
        if i not in batched:
            span = slice(seq.token_start, seq.token_start + seq.query_len)
            out_span = slice(seq.token_start - first, seq.token_start - first + seq.query_len)
            result[out_span] = _prefill_attention(q[span], k[span], v[span], flat_cache, seq, plan.scale)
    return result


def _padded(rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """rows[src] placed at dst of a zeroed [batch * length, ...], viewed as [batch, length, ...]."""
    out = rows.new_zeros(batch * length, *rows.shape[1:])
    out.index_copy_(0, dst, rows.index_select(0, src))
    return out.unflatten(0, (batch, length))


def _decode_attention(q: torch.Tensor, flat_cache: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """Batched one-token attention; q: [D, H, hd] -> [D, H, hd].

    Grouped matmuls instead of repeating KV heads: q is viewed as [D, kvh, group, hd] and K/V are
    gathered straight into [D, kvh, ctx, hd] (measured ~1.6x faster than a slot gather plus SDPA with
    enable_gqa on CPU for SmolLM2 shapes).
    """
    num_decodes, num_heads, head_dim = q.shape
    num_kv_heads = flat_cache.shape[1]
    assert plan.decode_k_rows is not None and plan.decode_v_rows is not None
    assert plan.decode_bias is not None
    shape = (num_decodes, num_kv_heads, plan.max_decode_ctx, head_dim)
    rows = flat_cache.view(-1, head_dim)  # [rows * kvh, hd]
    keys = rows.index_select(0, plan.decode_k_rows).view(shape)
    values = rows.index_select(0, plan.decode_v_rows).view(shape)
    q = q.view(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scale = head_dim**-0.5 if plan.scale is None else plan.scale
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [D, kvh, group, ctx]
    # Softmax in fp32 (a no-op cast for fp32), as SDPA does internally for low precision.
    probs = torch.softmax(scores + plan.decode_bias, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, values)  # [D, kvh, group, hd]
    return out.reshape(num_decodes, num_heads, head_dim)


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flat_cache: torch.Tensor, seq: PrefillPlan, scale: float | None
) -> torch.Tensor:
    """Causal attention of one chunk over its context; q: [Q, H, hd], k/v: [Q, kvh, hd] -> [Q, H, hd].

    4-D inputs ([1, heads, tokens, hd]): SDPA takes its fused kernels (flash, memory-efficient; on the CPU its
    flash kernel, measured 3x faster than the math path 3-D inputs get for SmolLM2's shapes). A chunk after
    cached context is causal from the lower right: query i sits at position ctx - Q + i. Where a window cuts into the
    context, the plan's mask (causal and the window) replaces both.
    """
    mask: torch.Tensor | None = seq.mask
    if seq.context_k is not None and seq.context_v is not None:  # (both or neither)
        k = flat_cache.index_select(0, seq.context_k)  # [keys, kvh, hd]
        v = flat_cache.index_select(0, seq.context_v)
        if mask is None:
            mask = causal_lower_right(q.shape[0], k.shape[0])
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )  # [1, H, Q, hd]
    return out[0].transpose(0, 1)


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes across all layers (keys and values)."""
    return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * dtype.itemsize


def allocate_kv_cache(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The whole model's cache: [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim].

    Zeroed, not empty: nothing in it is NaN before a request writes it (attention never reads a slot
    its sequence has not written, see `_plan_decodes`).
    """
    shape = (config.num_layers, num_blocks, 2, block_size, config.num_kv_heads, config.head_dim)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    cache = torch.empty(shape, dtype=dtype)
    huge_pages(cache)  # before the first touch, so the zeroing faults the pages in as huge ones
    return cache.zero_()


MADV_HUGEPAGE = 14  # linux/mman.h
HUGE_PAGE = 2 << 20


def huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back `tensor`'s memory (the 2 MiB pages wholly inside it) with transparent huge pages, as its
    `madvise` mode wants (the default of most distributions): a decode step reads every sequence's pages of the KV
    cache, scattered over the pool, and with 4 KiB pages nearly every page read is a TLB miss (decode attention ~5%
    faster in bf16, a served burst 1-3%: docs/performance.md). False where the kernel refuses or is not Linux."""
    start = -(-tensor.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // HUGE_PAGE * HUGE_PAGE
    if end <= start or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False
