"""Structured outputs' cost on workload W1: every request constrained by a JSON schema vs none, same run.

W1 (docs/benchmarks.md): SmolLM2-135M fp32, 32 requests of ~30 prompt tokens, 64 new tokens each, greedy,
all submitted at once, in-process (bench/throughput.py's engine loop). The constrained pass gives every
request `response_format: json_schema` with a schema no 64-token answer can complete (an object holding an
array of at least 40 strings), so both passes generate exactly 64 tokens a request and tok/s compare. Passes
alternate (unconstrained first), --rounds times, on one engine; medians are reported, with the grammar's own
per-step time (GrammarConstraint.fill_bitmask and advance, timed inside this process) and the whole step's
extra time per constrained row.

    python bench/structured.py [--requests 32] [--new-tokens 64] [--rounds 3] [--threads 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.throughput import w1_prompts  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core.llm_engine import LLMEngine  # noqa: E402
from engine.core.request import SamplingParams  # noqa: E402
from engine.structured import GrammarConstraint, compile_response_format  # noqa: E402
from loragate_common.stats import percentile  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string"}, "minItems": 40}},
    "required": ["notes"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "notes", "schema": SCHEMA, "strict": True}}


class GrammarTimer:
    """Seconds spent in GrammarConstraint.fill_bitmask and .advance (patched for the run)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        for name in ("fill_bitmask", "advance"):
            original = getattr(GrammarConstraint, name)
            setattr(GrammarConstraint, name, self._timed(original))

    def _timed(self, fn: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        return wrapper


def run_pass(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str) -> tuple[float, int, int]:
    """(seconds, tokens generated, steps) for all requests added at once and stepped to completion."""
    engine.scheduler.kv.reset_prefix_cache()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    generated = steps = 0
    while engine.has_unfinished_requests():
        generated += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    return time.perf_counter() - start, generated, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model="smollm2", pool_mb=256))
    tokenizer = engine.tokenizer
    prompts = [tokenizer.encode(text) for text in w1_prompts(args.requests)]
    grammar = compile_response_format(RESPONSE_FORMAT, tokenizer)
    n = args.new_tokens
    plain = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(
        max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True, constraint=grammar.constraint
    )
    run_pass(engine, prompts[:2], constrained, "warm-c")  # warm both paths (and the grammar's first matcher)
    run_pass(engine, prompts[:2], plain, "warm-p")
    timer = GrammarTimer()
    figures: dict[str, list[dict[str, float]]] = {"plain": [], "json_schema": []}
    for k in range(args.rounds):
        for name, params in (("plain", plain), ("json_schema", constrained)):
            timer.seconds, timer.calls = 0.0, 0
            seconds, generated, steps = run_pass(engine, prompts, params, f"{name}{k}")
            assert generated == len(prompts) * n, (name, generated)
            figures[name].append(
                {"tok_s": generated / seconds, "step_ms": 1000 * seconds / steps, "grammar_ms": 1000 * timer.seconds}
            )
            print(
                f"{name:12} {generated / seconds:7.1f} tok/s  {1000 * seconds / steps:6.2f} ms/step  "
                f"grammar {1000 * timer.seconds / steps:5.2f} ms/step",
                flush=True,
            )
    median = {name: {key: percentile([r[key] for r in rows], 0.5) for key in rows[0]} for name, rows in figures.items()}
    ratio = median["json_schema"]["tok_s"] / median["plain"]["tok_s"]
    steps = args.new_tokens  # decode steps per pass (+1 prefill): per-step figures below divide by it
    extra_ms = median["json_schema"]["step_ms"] - median["plain"]["step_ms"]
    grammar_ms = median["json_schema"]["grammar_ms"] / steps
    print(
        f"json_schema / plain: {ratio:.2f}x tok/s (target >= 0.85x); per step: +{extra_ms:.2f} ms in all "
        f"({1000 * extra_ms / args.requests:.0f} us a constrained row), of which the grammar (fill + advance) "
        f"{grammar_ms:.2f} ms ({1000 * grammar_ms / args.requests:.0f} us a row)"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"config": vars(args) | {"json": str(args.json)}, "rounds": figures, "median": median, "ratio": ratio},
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
