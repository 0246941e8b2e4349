"""Where a served burst's time goes, without a server: the burst `bench/served_vllm_client.py` sends (random
128-token prompts, 64 new tokens, EOS ignored, greedy, `--concurrency` at once, a new prompt as soon as one
finishes), run in-process on one warmed engine, every step timed alone.

Each burst prints its tok/s over wall time; the last burst's steps are split into those that carry prompt tokens
(prefill chunks, with the decodes that ride along) and decode-only steps: count, seconds, tokens, ms a step, and
the first few (tokens, ms). In-process tok/s runs within a few per cent of the served figure (docs/performance.md),
so what the split shows is what a served burst spends.

`--profile` then runs one more wave of `--concurrency` prompts and prints the torch profiler's ops of its second step
(512 prompt tokens) and of its 41st (decode-only): what a served prompt step and decode step spend, op by op.

    python bench/served_steps.py [--dtype float32|bfloat16] [--prompts 64] [--concurrency 32] [--bursts 3] [--profile]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import EngineConfig  # noqa: E402
from engine.core.llm_engine import LLMEngine  # noqa: E402
from engine.core.request import SamplingParams  # noqa: E402
from engine.core.scheduler import SchedulerOutput  # noqa: E402

# what the served client sends: random 128-token prompts, 64 new tokens, EOS ignored, greedy
PARAMS = SamplingParams(max_tokens=64, min_tokens=64, temperature=0.0, ignore_eos=True)


def random_prompts(engine: LLMEngine, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, engine.vocab_size - 100) for _ in range(128)] for _ in range(count)]


def burst(engine: LLMEngine, args: argparse.Namespace, seed: int) -> list[tuple[float, list[SchedulerOutput]]]:
    """One closed-loop burst; (seconds, what was scheduled) of each step (a step may schedule more than once: a
    critical arrival interrupts it, engine/core/llm_engine.py)."""
    prompts = random_prompts(engine, args.prompts, seed)
    scheduled: list[SchedulerOutput] = []
    schedule = engine.scheduler.schedule

    def recording() -> SchedulerOutput:
        scheduled.append(schedule())
        return scheduled[-1]

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    steps: list[tuple[float, list[SchedulerOutput]]] = []
    sent = live = tokens = 0
    start = time.perf_counter()
    try:
        while sent < args.prompts or engine.has_unfinished_requests():
            while sent < args.prompts and live < args.concurrency:
                engine.add_request(f"{seed}-{sent}", prompts[sent], PARAMS)
                sent, live = sent + 1, live + 1
            began, first = time.perf_counter(), len(scheduled)
            outputs = engine.step()
            steps.append((time.perf_counter() - began, scheduled[first:]))
            tokens += sum(len(o.new_token_ids) for o in outputs)
            live -= sum(o.finished for o in outputs)
    finally:
        engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    wall = time.perf_counter() - start
    print(f"burst {seed}: {tokens / wall:.1f} tok/s, {wall:.2f} s, {len(steps)} steps", flush=True)
    return steps


def profile_wave(engine: LLMEngine, args: argparse.Namespace, top: int = 8) -> None:
    """One wave of `--concurrency` prompts; the ops of its step 1 (a prompt step) and step 40 (decode-only)."""
    for i, prompt in enumerate(random_prompts(engine, args.concurrency, seed=0)):
        engine.add_request(f"profile-{i}", prompt, PARAMS)
    step = 0
    while engine.has_unfinished_requests():
        if step not in (1, 40):
            engine.step()
            step += 1
            continue
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            began = time.perf_counter()
            engine.step()
            wall = (time.perf_counter() - began) * 1e3
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in ops) / 1e3
        print(f"profiled step {step}: {wall:.1f} ms under the profiler, ops {total:.1f} ms")
        for e in ops[:top]:
            print(f"  {e.key:40s} {e.count:5d} calls {e.self_cpu_time_total / 1e3:8.2f} ms")
        step += 1


def prompt_tokens(batches: list[SchedulerOutput]) -> bool:
    return any(n > 1 for b in batches for n in b.num_tokens)


def total(batches: list[SchedulerOutput]) -> int:
    return sum(b.total_tokens for b in batches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="then profile a prompt step and a decode step")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model="smollm2", dtype=args.dtype))
    print(f"warm-up {engine.warm_up():.1f} s; {args.dtype}, {args.threads} threads")
    steps: list[tuple[float, list[SchedulerOutput]]] = []
    for seed in range(1, args.bursts + 1):
        steps = burst(engine, args, seed)
    for label, chosen in (
        ("steps with prompt tokens", [(s, b) for s, b in steps if prompt_tokens(b)]),
        ("decode-only steps", [(s, b) for s, b in steps if not prompt_tokens(b)]),
    ):
        if not chosen:
            continue
        seconds = sum(s for s, _ in chosen)
        tokens = sum(total(b) for _, b in chosen)
        first = ", ".join(f"({total(b)}, {s * 1e3:.0f})" for s, b in chosen[:8])
        print(
            f"{label}: {len(chosen)}, {seconds:.2f} s, {tokens} tokens, {seconds / len(chosen) * 1e3:.1f} ms a step;"
            f" first (tokens, ms): {first}"
        )
    if args.profile:
        profile_wave(engine, args)


if __name__ == "__main__":
    main()
