"""What LoRA costs a W1 step, measured so that a noisy machine slows both sides alike: W1 base and W1 mixed LoRA
(the 8 W1 adapters) on two engines in one process, their steps interleaved one for one, each step timed alone.

A VM whose speed drifts by 1.5x within minutes (this project's 2-core runners do) makes two W1 runs one after the
other disagree by more than the LoRA cost itself; interleaving single steps puts both engines through the same
drift. Each round runs W1 to completion on both engines (prefix cache reset, so every prompt is prefilled) and
prints each side's tok/s over its own step time and their ratio; the last line is the median over rounds.

    python bench/lora_cost.py [--dtype float32|bfloat16] [--rounds 5] [--backend cpp|torch] [--threads 2]

`--backend` picks the CPU's LoRA path for the LoRA engine (kernels/__init__.py `lora_backend`; the base engine has
no LoRA rows). `--adapters N` registers N adapters (the 8 W1 weight sets repeated) and gives request i adapter
i % N (bench/throughput.py `scale_adapter_dir`), for the cost of N distinct adapters in a batch.
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

from bench.throughput import make_w1_adapters, scale_adapter_dir, w1_prompts  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core.llm_engine import LLMEngine  # noqa: E402
from engine.core.request import SamplingParams  # noqa: E402
from engine.model.sources import cache_root, load_tokenizer, resolve_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--backend", default="cpp", choices=["cpp", "torch"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    resolved = resolve_model("smollm2")
    tok = load_tokenizer(resolved.path)
    prompts = [tok(t)["input_ids"] for t in w1_prompts(args.requests)]
    root = cache_root() / "bench-adapters"
    adapter_root = scale_adapter_dir(make_w1_adapters(resolved.path, root / "w1"), root, args.adapters)
    config = {"model": "smollm2", "dtype": args.dtype, "pool_mb": 256, "adapter_dir": str(adapter_root)}
    config["max_device_adapters"] = max(8, args.adapters)
    os.environ["LORAGATE_LORA_BACKEND"] = args.backend
    engines = {"base": LLMEngine(EngineConfig(**config)), "lora": LLMEngine(EngineConfig(**config))}
    params = SamplingParams(max_tokens=args.new_tokens, min_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    print(
        f"W1 ({args.requests} x {args.new_tokens} tokens), {args.dtype}, {args.threads} threads, LoRA path "
        f"{engines['lora'].runner.lora_backend}, {args.adapters} adapters; steps interleaved one for one"
    )
    ratios: list[float] = []
    figures: dict[str, list[float]] = {"base": [], "lora": []}
    for k in range(args.rounds + 1):  # round 0 warms both engines (first calls, adapter loads) and is not counted
        seconds = {"base": 0.0, "lora": 0.0}
        tokens = {"base": 0, "lora": 0}
        for name, engine in engines.items():
            engine.scheduler.kv.reset_prefix_cache()
            for i, p in enumerate(prompts):
                adapter = None if name == "base" else f"a{i % args.adapters:04d}"
                engine.add_request(f"{k}-{i}", p, params, adapter_id=adapter)
        while any(e.has_unfinished_requests() for e in engines.values()):
            for name, engine in engines.items():
                if engine.has_unfinished_requests():
                    start = time.perf_counter()
                    outputs = engine.step()
                    seconds[name] += time.perf_counter() - start
                    tokens[name] += sum(len(o.new_token_ids) for o in outputs)
        if k == 0:
            continue
        rates = {name: tokens[name] / seconds[name] for name in engines}
        ratios.append(rates["lora"] / rates["base"])
        for name in engines:
            figures[name].append(rates[name])
        print(
            f"round {k}: base {rates['base']:.1f} tok/s, mixed LoRA {rates['lora']:.1f} tok/s, "
            f"LoRA/base {ratios[-1]:.2f}"
        )
    print(
        f"median of {args.rounds}: base {statistics.median(figures['base']):.1f} tok/s, mixed LoRA "
        f"{statistics.median(figures['lora']):.1f} tok/s, LoRA/base {statistics.median(ratios):.2f}"
    )


if __name__ == "__main__":
    main()
