"""Batched-LoRA kernels: per-segment matmuls on pool views vs gather-bmm on CPU at SmolLM2-135M sizes, the
grouped twin (one shrink per fused projection) vs one call pair per module, and on a CUDA device the
Triton SGMV kernels (loragate_kernels/triton/sgmv.py) vs the same two at Llama-7B-like sizes.

(a) `loragate_kernels.reference.lora_sgmv`: one `mm` + one `addmm_` per segment on `as_strided` pool views.
(b) gather-bmm (below, bench only): pad segments to the longest and ranks to the largest, gather x
    rows and stack A/B (copies), two `torch.bmm`, scatter back with `index_add_`.

Prints µs per call (best of several repeats, so other processes on the machine inflate it less),
the ratio b/a, a dense [T, 576] x [576, 1536] matmul for scale, and the estimated per-step LoRA
overhead of (a) for decode (T=32 over 8 adapters, ranks 4/8/16, 7 modules, 30 layers).

    python bench/lora_kernels.py [--threads 2] [--repeats 25] [--dtype float32] [--gpu-only]

With CUDA (`--gpu-only` skips the CPU part): hidden 4096, rank 16, 1..256 tokens each of its own adapter,
fp16 and bf16; µs per call from CUDA events (median of repeats); the target is Triton >= 2x gather-bmm at
64 distinct adapters (Punica measured SGMV 37 -> 46 µs and gather+bmm 37 -> 116 µs from 1 to 64).

On a machine shared with other busy processes, 2-thread timings of these tiny matmuls stall for whole
scheduler slices (ms per call); `--threads 1` gives the stable numbers.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loragate_common.stats import nearest_rank, percentile  # noqa: E402
from loragate_kernels.reference import lora_sgmv, lora_sgmv_group  # noqa: E402

SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576)]
RANK_MIXES = {
    "4/8/16": lambda n, rng: [(4, 8, 16)[i % 3] for i in range(n)],
    "2..32": lambda n, rng: [rng.randint(2, 32) for _ in range(n)],
}
# name -> rows per adapter; the segment s uses slot s
BATCHES = {"decode 8x4": [4] * 8, "decode 32x1": [1] * 32, "prefill 8x128": [128] * 8, "skew 25+7x1": [25] + [1] * 7}
# SmolLM2-135M's seven LoRA targets: (in, out, width of the fused output the delta lands in)
MODULES = {
    "q": (576, 576, 960),
    "k": (576, 192, 960),
    "v": (576, 192, 960),
    "o": (576, 576, 576),
    "gate": (576, 1536, 3072),
    "up": (576, 1536, 3072),
    "down": (1536, 576, 576),
}
LAYERS = 30


def sgmv_gather_bmm(
    y: torch.Tensor,
    x: torch.Tensor,
    seg_starts: list[int],
    seg_slots: list[int],
    pool: torch.Tensor,
    a_offsets: list[int],
    b_offsets: list[int],
    ranks: list[int],
) -> None:
    """Strategy (b), same semantics as `lora_sgmv`: pad to [S, max_len] rows and max_rank, bmm twice."""
    segs = [
        (seg_starts[s], seg_starts[s + 1], k)
        for s, k in enumerate(seg_slots)
        if ranks[k] and seg_starts[s + 1] > seg_starts[s]
    ]
    if not segs:
        return
    d_in, d_out = x.shape[1], y.shape[1]
    lens = [hi - lo for lo, hi, _ in segs]
    rs = [ranks[k] for _, _, k in segs]
    max_len, max_r = max(lens), max(rs)
    dev = x.device
    lens_t = torch.tensor(lens, device=dev)
    pos = torch.arange(max_len, device=dev)
    valid = pos < lens_t[:, None]  # [S, L]
    rows = torch.tensor([lo for lo, _, _ in segs], device=dev)[:, None] + torch.minimum(pos, lens_t[:, None] - 1)
    # A and B.T (as the pool stores B) padded to max_r rows by reading past their ends; the over-read is masked
    # out of h and B (it may be another adapter's data or garbage).
    base = pool.storage_offset()
    a = torch.stack([pool.as_strided((max_r, d_in), (d_in, 1), base + a_offsets[k]) for _, _, k in segs])
    b = torch.stack([pool.as_strided((max_r, d_out), (d_out, 1), base + b_offsets[k]) for _, _, k in segs])
    rank_ok = torch.arange(max_r, device=dev) < torch.tensor(rs, device=dev)[:, None]  # [S, R]
    h = torch.bmm(x[rows], a.transpose(1, 2)).masked_fill_(~rank_ok[:, None, :], 0)  # [S, L, R]
    b = b.masked_fill_(~rank_ok[:, :, None], 0)  # [S, R, out]
    delta = torch.bmm(h, b)  # [S, L, out]
    y.index_add_(0, rows[valid], delta[valid])


def make_case(
    d_in: int, d_out: int, ranks: list[int], lens: list[int], dtype: torch.dtype, y_width: int | None = None
) -> tuple:
    """`lora_sgmv`'s arguments: adapters at interleaved, unaligned offsets in one pool, with slack at
    its end for (b)'s over-reads, and y a column slice of a `y_width`-wide output."""
    g = torch.Generator().manual_seed(0)
    a_offsets, b_offsets, cursor = [], [], 7
    for r in ranks:  # A_k, B_k, A_k+1, ... with an odd gap: no slot is aligned
        a_offsets.append(cursor)
        cursor += r * d_in + 3
        b_offsets.append(cursor)
        cursor += d_out * r + 5
    pool = (torch.randn(cursor + 64 * max(d_in, d_out), generator=g) * 0.05).to(dtype)
    t = sum(lens)
    x = torch.randn(t, d_in, generator=g).to(dtype)
    wide = torch.zeros(t, y_width or d_out, dtype=dtype)
    y = wide[:, :d_out]
    seg_starts = [0]
    for n in lens:
        seg_starts.append(seg_starts[-1] + n)
    return (y, x, seg_starts, list(range(len(lens))), pool, a_offsets, b_offsets, list(ranks))


def best_us(fn: Callable[[], object], repeats: int, repeat_s: float = 0.003) -> float:
    """Best-of-`repeats` mean µs per call, each repeat about `repeat_s` long: short repeats, so some
    land in gaps between other processes' work on a shared machine."""
    for _ in range(3):
        fn()
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < repeat_s:
        fn()
        n += 1
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n)
    return best * 1e6


def compare_table(repeats: int, dtype: torch.dtype) -> None:
    rng = random.Random(0)
    print(f"{'in x out':>11} {'ranks':>7} {'batch':>14} {'T':>5} {'(a) µs':>9} {'(b) µs':>9} {'b/a':>6}")
    wins = []
    for d_in, d_out in SHAPES:
        for mix_name, mix in RANK_MIXES.items():
            for batch_name, lens in BATCHES.items():
                args = make_case(d_in, d_out, mix(len(lens), rng), lens, dtype)
                check = args[0].clone()
                lora_sgmv(check, *args[1:])
                sgmv_gather_bmm(*args)  # y starts at zero: both strategies must give the same delta
                torch.testing.assert_close(args[0], check, rtol=1e-3, atol=1e-3)
                a_us = best_us(partial(lora_sgmv, *args), repeats)
                b_us = best_us(partial(sgmv_gather_bmm, *args), repeats)
                wins.append(b_us / a_us)
                print(
                    f"{d_in:>5}x{d_out:<5} {mix_name:>7} {batch_name:>14} {sum(lens):>5} "
                    f"{a_us:>9.1f} {b_us:>9.1f} {b_us / a_us:>6.2f}"
                )
    wins.sort()
    print(
        f"b/a over {len(wins)} cases: min {wins[0]:.2f}, median {nearest_rank(wins, 0.5):.2f}, "
        f"max {wins[-1]:.2f}  (>1: per-segment is faster)"
    )


def dense_us(t: int, d_in: int, d_out: int, repeats: int, dtype: torch.dtype) -> float:
    x = torch.randn(t, d_in).to(dtype)
    w = torch.randn(d_out, d_in).to(dtype)
    out = torch.empty(t, d_out, dtype=dtype)
    return best_us(lambda: torch.mm(x, w.t(), out=out), repeats)


def one_thread(fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` with intra-op threads dropped to 1 around it (a global setting; restored after)."""

    def run() -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            fn()
        finally:
            torch.set_num_threads(threads)

    return run


def step_overhead(repeats: int, dtype: torch.dtype) -> None:
    """Decode step, T=32 over 8 adapters of ranks 4/8/16: LoRA (a) vs the base matmuls it rides on."""
    lens, ranks = [4] * 8, [(4, 8, 16)[i % 3] for i in range(8)]
    threads = torch.get_num_threads()
    modes = {f"{threads} thr": lambda f: f} | ({"1 thr inside": one_thread} if threads > 1 else {})
    totals = dict.fromkeys(modes, 0.0)
    print(
        "\ndecode step, T=32 over 8 adapters (ranks 4/8/16), lora_sgmv µs per layer, y a column "
        "slice of the fused output:"
    )
    print(f"  {'module':>6} {'in x out':>11} " + " ".join(f"{m:>13}" for m in modes))
    for name, (d_in, d_out, width) in MODULES.items():
        args = make_case(d_in, d_out, ranks, lens, dtype, y_width=width)
        row = []
        for mode, wrap in modes.items():
            us = best_us(wrap(partial(lora_sgmv, *args)), repeats)
            totals[mode] += us
            row.append(f"{us:>13.1f}")
        print(f"  {name:>6} {d_in:>5}x{d_out:<5} " + " ".join(row))
    # The base model's fused projections (qkv, o, gate_up, down) per layer, and the tied lm_head.
    fused = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
    layer = sum(dense_us(32, i, o, repeats, dtype) for i, o in fused)
    head = dense_us(32, 576, 49152, repeats, dtype)
    base_ms = (layer * LAYERS + head) / 1e3
    print(
        f"  base matmuls: {layer:.1f} µs/layer, lm_head {head:.1f} µs: {base_ms:.2f} ms/step "
        f"(attention, norms and sampling not counted)"
    )
    for mode, total in totals.items():
        lora_ms = total * LAYERS / 1e3
        print(
            f"  LoRA ({mode}): {total:.1f} µs/layer x {LAYERS} layers = {lora_ms:.2f} ms/step, "
            f"{100 * lora_ms / base_ms:.0f}% of the base matmuls; throughput ratio >= "
            f"{base_ms / (base_ms + lora_ms):.2f}"
        )


def grouped_vs_per_module(repeats: int, dtype: torch.dtype) -> None:
    """Decode, T=32 over 8 adapters: the q/k/v group and the gate/up group as one shrink each (the engine's
    path) vs one shrink and one expand per module (the old one). Both give the same deltas."""
    print("\ngrouped twin vs per module, decode T=32 over 8 adapters (ranks 4/8/16), µs per layer:")
    for group, outs in (("qkv", [576, 192, 192]), ("gate_up", [1536, 1536])):
        g_us, s_us = grouped_and_per_module_us(outs, repeats, dtype)
        print(f"  {group:>7}: grouped {g_us:8.1f}  per module {s_us:8.1f}  ({s_us / g_us:.2f}x)")


def grouped_and_per_module_us(outs: list[int], repeats: int, dtype: torch.dtype) -> tuple[float, float]:
    """One group of `grouped_vs_per_module` (its modules' output widths `outs`): µs per call of each way."""
    lens, ranks = [4] * 8, [(4, 8, 16)[i % 3] for i in range(8)]
    d_in, width = 576, sum(outs)
    g = torch.Generator().manual_seed(1)
    a_off: list[int] = []
    b_off: list[list[int]] = [[] for _ in outs]
    cursor = 0
    for r in ranks:
        a_off.append(cursor)
        cursor += len(outs) * r * d_in
        for m, out in enumerate(outs):
            b_off[m].append(cursor)
            cursor += out * r
    pool = (torch.randn(cursor, generator=g) * 0.05).to(dtype)
    x = torch.randn(sum(lens), d_in, generator=g).to(dtype)
    y = torch.zeros(sum(lens), width, dtype=dtype)
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    slots = list(range(len(lens)))
    cols = [0]
    for out in outs:
        cols.append(cols[-1] + out)
    # Per module: module m's A is rows [m * r, (m + 1) * r) of the slot's stacked A.
    per_module = [
        (y[:, cols[m] : cols[m + 1]], [a + m * r * d_in for a, r in zip(a_off, ranks, strict=True)], b_off[m])
        for m in range(len(outs))
    ]

    def grouped() -> None:
        lora_sgmv_group(y, x, starts, slots, pool, a_off, [ranks] * len(outs), b_off, cols)

    def separate() -> None:
        for out_view, a_m, b_m in per_module:
            lora_sgmv(out_view, x, starts, slots, pool, a_m, b_m, ranks)

    check = y.clone()
    grouped()
    first = y.clone()
    y.copy_(check)
    separate()
    torch.testing.assert_close(y, first, rtol=1e-4, atol=1e-4)
    return best_us(grouped, repeats), best_us(separate, repeats)


def kernel_timer(device: torch.device, repeats: int) -> Callable[[Callable[[], object]], float]:
    """µs per call: the median of `repeats` single calls after warm-up; CUDA events on a GPU, perf_counter off it."""

    def timed(fn: Callable[[], object]) -> float:
        for _ in range(3 if device.type == "cuda" else 1):
            fn()
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
        return percentile(times, 0.5)

    return timed


def gpu_table(repeats: int) -> None:
    """Triton vs per-segment torch vs gather-bmm on CUDA, hidden 4096, rank 16, one adapter per token."""
    from loragate_kernels.triton.sgmv import GroupTables, column_tiles, lora_sgmv_group_triton, plan_segments

    dev = torch.device("cuda")
    timed = kernel_timer(dev, repeats)

    print(f"\nCUDA {torch.cuda.get_device_name()}: hidden 4096 -> 4096, rank 16, each token its own adapter")
    print(f"{'dtype':>6} {'T':>5} {'triton µs':>10} {'torch µs':>9} {'bmm µs':>8} {'bmm/triton':>11}")
    for dtype in (torch.float16, torch.bfloat16):
        for t in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            args = make_case(4096, 4096, [16] * t, [1] * t, dtype)
            y, x, starts, slots, pool, a_off, b_off, ranks = args
            y, x, pool = y.to(dev), x.to(dev), pool.to(dev)
            cuda_args = (y, x, starts, slots, pool, a_off, b_off, ranks)
            tables = GroupTables(
                torch.tensor(a_off, device=dev),
                torch.tensor([ranks], dtype=torch.int32, device=dev),
                torch.tensor([b_off], device=dev),
                torch.zeros(1, t, dtype=torch.int32, device=dev),
                torch.tensor(ranks, dtype=torch.int32, device=dev),
            )
            plan = plan_segments(starts, slots, dev)
            cols = torch.tensor([0, 4096], dtype=torch.int32, device=dev)
            tiles = column_tiles([0, 4096], dev)
            check = y.clone()
            lora_sgmv(check, x, starts, slots, pool, a_off, b_off, ranks)
            base = y.clone()
            lora_sgmv_group_triton(y, x, plan, pool, tables, cols, tiles, 16)
            torch.testing.assert_close(y - base, check - base, rtol=3e-2, atol=3e-2)
            tri = timed(partial(lora_sgmv_group_triton, y, x, plan, pool, tables, cols, tiles, 16))
            seg = timed(partial(lora_sgmv, *cuda_args))
            bmm = timed(partial(sgmv_gather_bmm, *cuda_args))
            name = str(dtype).removeprefix("torch.")
            print(f"{name:>6} {t:>5} {tri:>10.1f} {seg:>9.1f} {bmm:>8.1f} {bmm / tri:>11.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--gpu-only", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {args.threads} threads, {args.dtype}\n")
    if not args.gpu_only:
        compare_table(args.repeats, dtype)
        print("\ndense [T, 576] x [576, 1536] for scale:")
        for t in (32, 1024):
            print(f"  T={t:<5} {dense_us(t, 576, 1536, args.repeats, dtype):9.1f} µs")
        step_overhead(args.repeats, dtype)
        grouped_vs_per_module(args.repeats, dtype)
    if torch.cuda.is_available():
        gpu_table(args.repeats)
    else:
        print("\nno CUDA device: the Triton kernels' timings are skipped (tests run them under the interpreter)")


if __name__ == "__main__":
    main()
