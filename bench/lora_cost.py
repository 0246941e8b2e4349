"""What LoRA costs a W1 step, measured so that a noisy machine slows every side alike: W1 on one engine per side in
one process, their steps interleaved one for one, each step timed alone.

A VM whose speed drifts by 1.5x within minutes (this project's 2-core runners do) makes two W1 runs one after the
other disagree by more than the LoRA cost itself; interleaving single steps puts every engine through the same
drift. Each round runs W1 (32 requests x 64 new tokens, greedy) to completion on every side (prefix cache reset, so
every prompt is prefilled), and prints each side's tok/s over its own step time and its ratio to the first side;
the last lines are the medians over rounds. Round 0 warms the engines (first calls, adapter loads) and is not
counted, so the figures are warm ones.

Sides (`--sides`, comma-separated; default `base,mixed`):
- `base`: no adapter;
- `mixed`: W1's mixed LoRA, request i on W1 adapter i % 8;
- `zipf:N`: N registered adapters (the 8 W1 weight sets under N ids, bench/throughput.py `scale_adapter_dir`),
  request ids drawn with Zipf popularity as bench/throughput.py's adapter-scale pass draws them, device tier 64.

    python bench/lora_cost.py [--dtype float32|bfloat16] [--rounds 5] [--sides base,mixed] [--backend cpp|torch]

`--sides mixed,zipf:512` is the adapter-scale target (512 registered adapters within 10% of 8). `--backend` picks
the CPU's LoRA path (loragate_kernels/__init__.py `lora_backend`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.throughput import SCALE_TIER, make_w1_adapters, scale_adapter_dir, w1_prompts, zipf_choices  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core.llm_engine import LLMEngine  # noqa: E402
from engine.core.request import SamplingParams  # noqa: E402
from engine.model.sources import cache_root, load_tokenizer, resolve_model  # noqa: E402


def side_engine(side: str, dtype: str, requests: int) -> tuple[LLMEngine, list[str | None]]:
    """The engine for one side and the adapter id of each W1 request on it."""
    root = cache_root() / "bench-adapters"
    weight_dirs = make_w1_adapters(resolve_model("smollm2").path, root / "w1")
    config: dict[str, Any] = {"model": "smollm2", "dtype": dtype, "pool_mb": 256}
    if side == "base":
        return LLMEngine(EngineConfig(**config)), [None] * requests
    if side == "mixed":
        engine = LLMEngine(EngineConfig(**config, adapter_dir=str(weight_dirs[0].parent)))
        return engine, [weight_dirs[i % 8].name for i in range(requests)]
    kind, _, count = side.partition(":")
    if kind != "zipf" or not count.isdigit() or int(count) < 1:
        raise SystemExit(f"unknown side {side!r}: base, mixed or zipf:N")
    scale_dir = scale_adapter_dir(weight_dirs, root, int(count))
    engine = LLMEngine(
        EngineConfig(**{**config, "pool_mb": 1024}, adapter_dir=str(scale_dir), max_device_adapters=SCALE_TIER)
    )
    return engine, [f"a{k:04d}" for k in zipf_choices(int(count), requests)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sides", default="base,mixed")
    ap.add_argument("--backend", default="cpp", choices=["cpp", "torch"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(resolve_model("smollm2").path)
    prompts = [tok(t)["input_ids"] for t in w1_prompts(args.requests)]
    os.environ["LORAGATE_LORA_BACKEND"] = args.backend
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    engines = {side: side_engine(side, args.dtype, args.requests) for side in sides}
    params = SamplingParams(max_tokens=args.new_tokens, min_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    first = sides[0]
    print(
        f"W1 ({args.requests} x {args.new_tokens} tokens), {args.dtype}, {args.threads} threads, LoRA path "
        f"{args.backend}; sides {', '.join(sides)}; steps interleaved one for one; ratios to {first}"
    )
    rates: dict[str, list[float]] = {side: [] for side in sides}
    for k in range(args.rounds + 1):
        seconds = dict.fromkeys(sides, 0.0)
        tokens = dict.fromkeys(sides, 0)
        for engine, ids in engines.values():
            engine.scheduler.kv.reset_prefix_cache()
            for i, (prompt, adapter) in enumerate(zip(prompts, ids, strict=True)):
                engine.add_request(f"{k}-{i}", prompt, params, adapter_id=adapter)
        while any(engine.has_unfinished_requests() for engine, _ in engines.values()):
            for side, (engine, _) in engines.items():
                if engine.has_unfinished_requests():
                    start = time.perf_counter()
                    outputs = engine.step()
                    seconds[side] += time.perf_counter() - start
                    tokens[side] += sum(len(o.new_token_ids) for o in outputs)
        if k == 0:
            continue
        for side in sides:
            rates[side].append(tokens[side] / seconds[side])
        print(
            f"round {k}: "
            + ", ".join(
                f"{side} {rates[side][-1]:.1f} tok/s ({rates[side][-1] / rates[first][-1]:.2f})" for side in sides
            )
        )
    medians = {side: statistics.median(rates[side]) for side in sides}
    ratios = {side: statistics.median(r / b for r, b in zip(rates[side], rates[first], strict=True)) for side in sides}
    print(
        f"median of {args.rounds}: "
        + ", ".join(f"{side} {medians[side]:.1f} tok/s (ratio {ratios[side]:.2f})" for side in sides)
    )


if __name__ == "__main__":
    main()
