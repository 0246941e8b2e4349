"""Where a W1 decode step's time goes: the torch profiler's per-op table for one engine step at 32 running
requests (W1's prompts, all decoding), base model and mixed LoRA (the 8 W1 adapters), at one dtype.

The engine is built and warmed, all 32 requests are added and stepped past their prefill, then `--steps` decode
steps are profiled; the table lists the ops with the most self CPU time per step, and the step's mean wall time
(with and without the profiler, which adds a few µs an op). Rows are greedy unless `--temperature` is set (a model
card's sampling defaults, e.g. Gemma 3's `--temperature 1 --top-k 64 --top-p 0.95`).

    python bench/step_profile.py [--dtype float32|bfloat16] [--lora] [--steps 10] [--threads 2] [--top 20]
        [--temperature T --top-k K --top-p P]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.throughput import make_w1_adapters, w1_adapter_root, w1_prompts  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core.llm_engine import LLMEngine  # noqa: E402
from engine.core.request import SamplingParams  # noqa: E402
from engine.model.sources import load_tokenizer, resolve_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--lora", action="store_true", help="request i served by W1 adapter i %% 8")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (default: greedy)")
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--no-head-screen", action="store_true", help="greedy rows compute the whole fp32 LM head")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    resolved = resolve_model(args.model)
    tok = load_tokenizer(resolved.path)
    prompts = [tok(t)["input_ids"] for t in w1_prompts(args.requests)]
    config: dict = {"model": args.model, "dtype": args.dtype, "pool_mb": 256, "head_screen": not args.no_head_screen}
    adapters: list[str | None] = [None] * len(prompts)
    if args.lora:
        dirs = make_w1_adapters(resolved.path, w1_adapter_root(args.model, resolved.path))
        config["adapter_dir"] = str(dirs[0].parent)
        adapters = [dirs[i % 8].name for i in range(len(prompts))]
    engine = LLMEngine(EngineConfig(**config))
    params = SamplingParams(
        max_tokens=1_000,
        min_tokens=1_000,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        ignore_eos=True,
    )
    for i, (p, adapter) in enumerate(zip(prompts, adapters, strict=True)):
        engine.add_request(f"r{i}", p, params, adapter_id=adapter)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()
    for _ in range(5):  # warm the decode shapes
        engine.step()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    plain_ms = (time.perf_counter() - start) / args.steps * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        profiled_ms = (time.perf_counter() - start) / args.steps * 1e3
    sampling = "greedy" if args.temperature == 0 else f"T {args.temperature}, top-k {args.top_k}, top-p {args.top_p}"
    rows = "mixed LoRA" if args.lora else "base"
    label = f"{args.dtype}, {rows}, {len(prompts)} decoding, {sampling}, {args.threads} threads"
    print(f"decode step ({label}): {plain_ms:.1f} ms ({profiled_ms:.1f} ms under the profiler)")
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    print(f"{'op':40s} {'calls/step':>10s} {'self ms/step':>12s} {'share':>6s}")
    for e in events[: args.top]:
        share = e.self_cpu_time_total / total
        per_step_ms = e.self_cpu_time_total / 1e3 / args.steps
        print(f"{e.key[:40]:40s} {e.count / args.steps:10.0f} {per_step_ms:12.2f} {share:6.1%}")


if __name__ == "__main__":
    main()
