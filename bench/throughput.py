"""Throughput on workload W1 (FACTS.md): SmolLM2-135M fp32, 32 requests of ~30 prompt tokens, 64 new
tokens each, greedy, all submitted at once, 2 threads. Prints our engine's tokens/s, then HF transformers'
batched `generate` on the same prompts in the same run, and the ratio.

    python bench/throughput.py [--requests 32] [--new-tokens 64] [--threads 2] [--skip-hf]
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
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model.sources import load_tokenizer, resolve_model  # noqa: E402
from engine.request import SamplingParams  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while serving many adapters at once".split()


def w1_prompts(n: int) -> list[str]:
    random.seed(0)
    return [" ".join(random.choice(WORDS) for _ in range(24)) for _ in range(n)]


def bench_engine(model: str, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """Our engine: all requests added at once, stepped to completion. Returns (seconds, tok/s)."""
    engine = LLMEngine(EngineConfig(model=model, pool_mb=256))
    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0,
                            ignore_eos=True)
    engine.add_request("warmup", prompts[0], SamplingParams(max_tokens=4, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    generated = 0
    while engine.has_unfinished_requests():
        generated += sum(len(o.new_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - start
    assert generated == len(prompts) * new_tokens
    return elapsed, generated / elapsed


def bench_hf(model_dir: Path, texts: list[str], new_tokens: int) -> tuple[float, float]:
    """HF transformers batched `generate` (left padding), the same prompts. Returns (seconds, tok/s)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    tok = load_tokenizer(model_dir)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              pad_token_id=tok.pad_token_id, eos_token_id=None)
    batch = tok(texts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        model.generate(**tok(texts[:1], return_tensors="pt"),
                       generation_config=GenerationConfig(max_new_tokens=4, do_sample=False,
                                                          pad_token_id=tok.pad_token_id))
        start = time.perf_counter()
        out = model.generate(**batch, generation_config=config)
        elapsed = time.perf_counter() - start
    generated = (out.shape[1] - batch["input_ids"].shape[1]) * len(texts)
    return elapsed, generated / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    resolved = resolve_model(args.model)
    tok = load_tokenizer(resolved.path)
    texts = w1_prompts(args.requests)
    prompts = [tok(t)["input_ids"] for t in texts]
    mean_len = sum(map(len, prompts)) / len(prompts)
    print(f"W1 base: {args.requests} requests, {mean_len:.1f} prompt tokens on average, "
          f"{args.new_tokens} new tokens each, fp32, {args.threads} threads")
    secs, ours = bench_engine(args.model, prompts, args.new_tokens)
    print(f"loragate engine        {ours:7.1f} tok/s  ({secs:.2f} s)")
    if args.skip_hf:
        return
    secs, hf = bench_hf(resolved.path, texts, args.new_tokens)
    print(f"HF transformers batch  {hf:7.1f} tok/s  ({secs:.2f} s)")
    print(f"ratio loragate / HF    {ours / hf:7.2f}x")
    print("reference (FACTS.md): vLLM-CPU base-only 53.6 tok/s; target >= 107 tok/s")


if __name__ == "__main__":
    main()
