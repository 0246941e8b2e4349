"""What LoRA costs a W1 step, measured so that neither a noisy machine nor where an engine's memory happens to lie
favours a side: W1 on identical engines in one process, one per side, their steps interleaved one for one, each
step timed alone, and the sides moved to the next engine every round.

A VM whose speed drifts by 1.5x within minutes (this project's 2-core runners do) makes two W1 runs one after the
other disagree by more than the LoRA cost itself; interleaving single steps puts every side through the same
drift. Two engines built alike in one process also differ, by up to ~3% a step (where their weights and caches
landed): so every engine here has the same configuration (the same registered adapters, pool and device tier), any
engine can run any side, and round k runs side j on engine (j + k) mod n; over n rounds every side has run on every
engine. Within a round, each turn of steps starts one side later, so no side always steps right after the same
other. Each round runs W1 (32 requests x 64 new tokens, greedy) to completion on every side (prefix cache reset, so
every prompt is prefilled), and prints each side's tok/s over its own step time and its ratio to the first side;
the last lines are the medians over rounds. Before the first round every engine runs every side's requests for two
tokens (first calls, adapter loads), so the figures are warm ones.

Sides (`--sides`, comma-separated; default `base,mixed`):
- `base`: no adapter;
- `mixed`: W1's mixed LoRA, request i on W1 adapter i % 8;
- `zipf:N`: N registered adapters (the 8 W1 weight sets under N ids, bench/throughput.py `scale_adapter_dir`),
  request ids drawn with Zipf popularity as bench/throughput.py's adapter-scale pass draws them.
Every engine registers the largest N's ids (at least 8; the first 8 are W1's weight sets, which `mixed` uses) with
a device tier of 64 adapters.

    python bench/lora_cost.py [--dtype float32|bfloat16] [--rounds 4] [--sides base,mixed] [--backend cpp|torch]

`--sides mixed,zipf:512` is the adapter-scale target (512 registered adapters within 10% of 8). Rounds in a multiple
of the number of sides put every side on every engine equally often. `--backend` picks the CPU's LoRA path
(loragate_kernels/__init__.py `lora_backend`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.throughput import SCALE_TIER, make_w1_adapters, scale_adapter_dir, w1_prompts, zipf_choices  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core.llm_engine import LLMEngine  # noqa: E402
from engine.core.request import SamplingParams  # noqa: E402
from engine.model.sources import cache_root, load_tokenizer, resolve_model  # noqa: E402


def side_ids(side: str, requests: int) -> list[str | None]:
    """The adapter id of each W1 request on a side (ids as `shared_config`'s adapter directory names them)."""
    if side == "base":
        return [None] * requests
    if side == "mixed":
        return [f"a{i % 8:04d}" for i in range(requests)]
    kind, _, count = side.partition(":")
    if kind != "zipf" or not count.isdigit() or int(count) < 1:
        raise SystemExit(f"unknown side {side!r}: base, mixed or zipf:N")
    return [f"a{k:04d}" for k in zipf_choices(int(count), requests)]


def shared_config(dtype: str, registered: int) -> EngineConfig:
    """One configuration for every engine, so any can run any side: `registered` adapter ids over the 8 W1 weight
    sets (id k on set k % 8)."""
    root = cache_root() / "bench-adapters"
    weight_dirs = make_w1_adapters(resolve_model("smollm2").path, root / "w1")
    scale_dir = scale_adapter_dir(weight_dirs, root, registered)
    return EngineConfig(
        model="smollm2", dtype=dtype, pool_mb=1024, adapter_dir=str(scale_dir), max_device_adapters=SCALE_TIER
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=4)
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
    ids = {side: side_ids(side, args.requests) for side in sides}
    registered = max([8] + [int(side.partition(":")[2]) for side in sides if side.startswith("zipf:")])
    config = shared_config(args.dtype, registered)
    engines = [LLMEngine(config) for _ in sides]
    params = SamplingParams(max_tokens=args.new_tokens, min_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    first = sides[0]
    print(
        f"W1 ({args.requests} x {args.new_tokens} tokens), {args.dtype}, {args.threads} threads, LoRA path "
        f"{args.backend}; sides {', '.join(sides)} on {len(engines)} identical engines, moved to the next engine "
        f"every round; steps interleaved one for one; ratios to {first}"
    )
    # warm-up: every engine runs every side's requests for two tokens (first calls of each shape, adapter loads)
    warm = SamplingParams(max_tokens=2, min_tokens=2, temperature=0.0, ignore_eos=True)
    for e, engine in enumerate(engines):
        for side in sides:
            for i, (prompt, adapter) in enumerate(zip(prompts, ids[side], strict=True)):
                engine.add_request(f"warm-{e}-{side}-{i}", prompt, warm, adapter_id=adapter)
            while engine.has_unfinished_requests():
                engine.step()
    rates: dict[str, list[float]] = {side: [] for side in sides}
    for k in range(1, args.rounds + 1):
        on = {side: engines[(j + k) % len(engines)] for j, side in enumerate(sides)}  # round k: side j on j + k
        seconds = dict.fromkeys(sides, 0.0)
        tokens = dict.fromkeys(sides, 0)
        for side, engine in on.items():
            engine.scheduler.kv.reset_prefix_cache()
            for i, (prompt, adapter) in enumerate(zip(prompts, ids[side], strict=True)):
                engine.add_request(f"{k}-{side}-{i}", prompt, params, adapter_id=adapter)
        turn = 0
        while any(engine.has_unfinished_requests() for engine in on.values()):
            # each turn starts one side later, so that no side always steps right after the same other side
            for side in sides[turn % len(sides) :] + sides[: turn % len(sides)]:
                engine = on[side]
                if engine.has_unfinished_requests():
                    start = time.perf_counter()
                    outputs = engine.step()
                    seconds[side] += time.perf_counter() - start
                    tokens[side] += sum(len(o.new_token_ids) for o in outputs)
            turn += 1
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
