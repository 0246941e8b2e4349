"""Prompt rows on the paged attention kernel against SDPA, per layer: the rows a prefill step hands
loragate_kernels/cpu/attention.cpp (engine/model/attention.py `_paged_rows`: a prompt token at position p is a row with
context p + 1 over its sequence's pages) and torch's `scaled_dot_product_attention` (causal) on the same K/V laid out
dense, SmolLM2's heads (9 query heads, 3 kv heads, head dim 64), 16-token pages scattered over the cache.

Each shape prints the median ms of a layer for both, and the largest difference between their outputs. `--root` loads
the kernel from another checkout (a "before" column); `--layers 30` runs 30 layers' caches in turn (a step's worth,
caches not in L2) instead of one.

    python bench/prompt_attention.py [--dtype float32|bfloat16] [--shapes 4x128,2x256,1x512,1x1024,1x2048]
                                     [--layers 1] [--threads 2] [--root DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def median_ms(fn: Callable[[], object], repeats: int = 15) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--shapes", default="4x128,2x256,1x512,1x1024,1x2048", help="PROMPTSxTOKENS, comma-separated")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--root", default=str(Path(__file__).resolve().parent.parent), help="the checkout to load")
    args = ap.parse_args()
    sys.path.insert(0, args.root)
    from loragate_kernels.cpu import build

    assert build.load(), build.unavailable_reason()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"{args.dtype}, {args.threads} threads, {args.layers} layer(s) a call, kernel from {args.root}")
    for shape in args.shapes.split(","):
        prompts, tokens = (int(v) for v in shape.split("x"))
        kernel_ms, sdpa_ms, diff = run_shape(prompts, tokens, args.layers, dtype)
        print(f"{prompts} x {tokens}: kernel {kernel_ms:.2f} ms, SDPA {sdpa_ms:.2f} ms a layer; max diff {diff:.1e}")


def run_shape(prompts: int, tokens: int, layers: int, dtype: torch.dtype) -> tuple[float, float, float]:
    """(kernel ms, SDPA ms) a layer, and the largest difference between their outputs."""
    op, scale = torch.ops.loragate_cpu.paged_decode_attention, HEAD_DIM**-0.5
    g = torch.Generator().manual_seed(prompts * 10_000 + tokens)
    per = -(-tokens // BLOCK)
    pages = prompts * per + 4
    caches = torch.randn(layers, pages, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    owned = torch.randperm(pages, generator=g)[: prompts * per].view(prompts, per)
    tables = owned.repeat_interleave(tokens, 0).contiguous()
    lens = torch.arange(1, tokens + 1).repeat(prompts)
    q = torch.randn(prompts * tokens, HEADS, HEAD_DIM, generator=g).to(dtype)

    def dense(layer: int, kv: int) -> torch.Tensor:  # [prompts, HEADS, tokens, HEAD_DIM]
        rows = caches[layer][owned, kv].reshape(prompts, per * BLOCK, KV_HEADS, HEAD_DIM)[:, :tokens]
        return rows.transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, 1).contiguous()

    keys = [dense(layer, 0) for layer in range(layers)]
    values = [dense(layer, 1) for layer in range(layers)]
    q_dense = q.view(prompts, tokens, HEADS, HEAD_DIM).transpose(1, 2)

    def kernel() -> torch.Tensor:
        return [op(q, caches[layer], tables, lens, scale) for layer in range(layers)][-1]

    def sdpa() -> torch.Tensor:
        out = [
            F.scaled_dot_product_attention(q_dense, keys[layer], values[layer], is_causal=True)
            for layer in range(layers)
        ][-1]
        return out.transpose(1, 2).reshape(prompts * tokens, HEADS, HEAD_DIM)

    diff = (kernel().float() - sdpa().float()).abs().max().item()
    return median_ms(kernel) / layers, median_ms(sdpa) / layers, diff


if __name__ == "__main__":
    main()
