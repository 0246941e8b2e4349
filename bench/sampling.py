"""What sampling a step's rows costs: the engine's sampler (engine/worker/sampler.py, which draws rows among their top
candidates, `draw_from_candidates`) against the whole-row draw it replaces and is checked against (`Sampler.process`
over every row, a softmax and the inverse CDF over the whole vocabulary: tests/engine/test_sampler.py), at the
vocabularies of SmolLM2, Qwen2.5 and Gemma 3 and the sampling defaults of their model cards, 32 rows.

The logits are random, peaked like a language model's (N(0, 1) x `--scale`, so a nucleus holds a handful of tokens
to a few hundred). Both sides run in one process, their calls interleaved, and the figure is the median of
`--repeats` calls each (ms), with the ratio whole-row / sampler.

    python bench/sampling.py [--threads 2] [--rows 32] [--repeats 15] [--scale 3.0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.core.request import Request, SamplingParams  # noqa: E402
from engine.worker.sampler import Sampler, sample_inverse_cdf  # noqa: E402

# (model, vocabulary, its generation_config's sampling defaults)
CASES = [
    ("SmolLM2", 49_152, SamplingParams(temperature=0.2, top_p=0.9)),
    ("Qwen2.5", 151_936, SamplingParams(temperature=0.7, top_k=20, top_p=0.8)),
    ("Gemma 3", 262_144, SamplingParams(temperature=1.0, top_k=64, top_p=0.95)),
    ("Gemma 3, temperature alone", 262_144, SamplingParams(temperature=1.0)),
]


def whole_row(sampler: Sampler, logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """The whole-row draw: every row filtered in full, then the inverse CDF over the vocabulary."""
    processed = sampler.process(logits, requests)
    u = torch.rand(len(requests), dtype=torch.float64)
    return sample_inverse_cdf(torch.softmax(processed, dim=-1), u).tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--scale", type=float, default=3.0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.rows} rows, {args.threads} threads, logits N(0, 1) x {args.scale}; median ms per step")
    print(f"{'model (defaults)':58s} {'vocab':>7s} {'sampler':>8s} {'whole-row':>9s} {'ratio':>6s}")
    for name, vocab, params in CASES:
        logits = torch.randn(args.rows, vocab, generator=torch.Generator().manual_seed(vocab)) * args.scale
        requests = [Request(f"r{i}", [1, 2, 3], params) for i in range(args.rows)]
        sampler = Sampler((2,), seed=0)
        sides: dict[str, Callable[[], object]] = {
            "sampler": partial(sampler, logits, requests),
            "whole": partial(whole_row, sampler, logits, requests),
        }
        times: dict[str, list[float]] = {side: [] for side in sides}
        for _ in range(2):  # warm
            for run in sides.values():
                run()
        for _ in range(args.repeats):
            for side, run in sides.items():
                start = time.perf_counter()
                run()
                times[side].append(time.perf_counter() - start)
        ours, whole = (statistics.median(times[side]) * 1e3 for side in ("sampler", "whole"))
        label = f"{name} (T {params.temperature}, top-k {params.top_k}, top-p {params.top_p})"
        print(f"{label[:58]:58s} {vocab:7d} {ours:8.1f} {whole:9.1f} {whole / ours:5.1f}x")


if __name__ == "__main__":
    main()
