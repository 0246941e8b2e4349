"""Priority scheduling and prefix caching on SmolLM2 (fp32, 2 threads), measured in one run.

1. Overload: 48 standard/sheddable requests (64 prompt tokens, 96 new) fill the engine (16 running at
   most); 8 critical requests arrive one every 0.4 s. Critical TTFT p50/p99 is compared with the same
   critical requests on an idle engine (target: within 2x).
2. Shared prefix: 24 requests share a ~300-token system prompt and differ in their last few tokens,
   sent one after another; mean TTFT with the adapter-aware prefix cache vs without it.

    python bench/priority.py [--model smollm2] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import EngineConfig  # noqa: E402
from engine.core.llm_engine import LLMEngine  # noqa: E402
from engine.core.request import SamplingParams
from loragate.priority import Priority

WORDS = "the quick brown fox jumps over a lazy dog while serving many adapters at once".split()


def words(n: int, offset: int) -> str:
    return " ".join(WORDS[(offset + 3 * i) % len(WORDS)] for i in range(n))


def run_open_loop(engine: LLMEngine, arrivals: list[tuple[float, str, list[int], SamplingParams,
                                                             Priority]]) -> dict[str, float]:
    """Submit each request at its arrival offset (seconds), step until all finish; TTFT per id."""
    pending = sorted(arrivals, key=lambda a: a[0])
    start = time.perf_counter()
    arrived: dict[str, float] = {}
    ttft: dict[str, float] = {}
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            _, rid, prompt, params, priority = pending.pop(0)
            engine.add_request(rid, prompt, params, priority)
            arrived[rid] = time.perf_counter()
        if not engine.has_unfinished_requests():
            time.sleep(min(0.01, max(0.0, pending[0][0] - now)))
            continue
        for out in engine.step():
            if out.new_token_ids and out.request_id not in ttft:
                ttft[out.request_id] = time.perf_counter() - arrived[out.request_id]
    return ttft


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def overload(model: str) -> None:
    config = EngineConfig(model=model, pool_mb=256, max_num_seqs=16, preemption="auto")
    engine = LLMEngine(config)
    tok = engine.tokenizer
    background = SamplingParams(max_tokens=96, min_tokens=96, temperature=0.0, ignore_eos=True)
    critical = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0, ignore_eos=True)
    crit_prompts = [tok(words(40, 100 + k))["input_ids"] for k in range(8)]
    arrivals = [(0.0, f"bg{i}", tok(words(64, i))["input_ids"], background,
                 Priority.STANDARD if i % 2 else Priority.SHEDDABLE) for i in range(48)]
    arrivals += [(1.0 + 0.4 * k, f"crit{k}", crit_prompts[k], critical, Priority.CRITICAL)
                 for k in range(8)]
    loaded = run_open_loop(engine, arrivals)
    idle_engine = LLMEngine(config)
    idle = {}
    for k, prompt in enumerate(crit_prompts):
        idle.update(run_open_loop(idle_engine, [(0.0, f"crit{k}", prompt, critical, Priority.CRITICAL)]))
    crit = [loaded[f"crit{k}"] for k in range(8)]
    base = [idle[f"crit{k}"] for k in range(8)]
    print(f"overload: critical TTFT p50 {1e3 * pct(crit, 0.5):7.1f} ms  p99 {1e3 * pct(crit, 0.99):7.1f} ms"
          f"   idle engine p50 {1e3 * pct(base, 0.5):7.1f} ms  p99 {1e3 * pct(base, 0.99):7.1f} ms")
    print(f"          ratio p50 {pct(crit, 0.5) / pct(base, 0.5):.2f}x  p99 {pct(crit, 0.99) / pct(base, 0.99):.2f}x"
          f"  (target <= 2x); preemptions {dict(engine.scheduler.preemption.counts)}")
    others = [v for k, v in loaded.items() if k.startswith("bg")]
    print(f"          background TTFT p50 {pct(others, 0.5):.2f} s  p99 {pct(others, 0.99):.2f} s")


def shared_prefix(model: str) -> None:
    results = {}
    for enabled in (False, True):
        engine = LLMEngine(EngineConfig(model=model, pool_mb=256, enable_prefix_cache=enabled))
        tok = engine.tokenizer
        system = words(300, 7)
        params = SamplingParams(max_tokens=1, temperature=0.0)
        ttfts = []
        for k in range(24):
            prompt = tok(f"{system} question {k}: {words(6, k)}")["input_ids"]
            ttfts += run_open_loop(engine, [(0.0, f"q{k}", prompt, params, Priority.STANDARD)]).values()
        results[enabled] = statistics.mean(ttfts[1:])  # the first request fills the cache
        hits, queries = engine.scheduler.kv.prefix_hits, engine.scheduler.kv.prefix_queries
        print(f"shared prefix, cache {'on ' if enabled else 'off'}: mean TTFT {1e3 * results[enabled]:7.1f} ms"
              f"  (hit tokens {hits}/{queries})")
    print(f"          TTFT with / without prefix cache: {results[True] / results[False]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    overload(args.model)
    shared_prefix(args.model)


if __name__ == "__main__":
    main()
