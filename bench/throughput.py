"""Throughput on workload W1 (docs/benchmarks.md): SmolLM2-135M fp32, 32 requests of ~30 prompt tokens, 64 new
tokens each, greedy, all submitted at once, 2 threads. `--model` takes another model: "tiny-random", a directory,
or a random-weight model with a real model's shape (bench/shaped_models.py, e.g. "gemma3-270m-shape").

- base: our engine vs HF transformers' batched `generate` on the same prompts, in the same run;
- mixed LoRA: 8 PEFT adapters (r = 4/8/16, alpha = 2r, all 7 modules, lora_B ~ N(0, 0.02^2) seeded by
  adapter index), request i served by adapter i % 8; LoRA/base ratio, and HF + PEFT batched per adapter;
- scale: 512 registered adapters (ids over the 8 weight sets), a device tier of 64, Zipf popularity; with
  `--scale-counts 8,64,512,2048` the same pass for each count, one after another (the adapter-scale curve).

    python bench/throughput.py [--model smollm2] [--requests 32] [--new-tokens 64] [--threads 2] [--dtype float32]
                               [--skip-hf] [--skip-lora]
                               [--scale-counts 512] [--json PATH]

`--json PATH` also writes every figure as one JSON object (bench/report.py reads it): `config`, `base`
(`loragate_tok_s`, `hf_tok_s`), `mixed` (`loragate_tok_s`, `lora_base_ratio`, `hf_peft_tok_s`) and `scale`
(one entry per count: `adapters`, `device_tier`, `distinct_in_batch`, `cold_tok_s`, `warm_tok_s`).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.shaped_models import model_spec  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core.llm_engine import LLMEngine  # noqa: E402
from engine.core.request import SamplingParams  # noqa: E402
from engine.model.sources import cache_root, load_tokenizer, resolve_model  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while serving many adapters at once".split()
SCALE_TIER = 64  # the scale passes' device tier (--max-device-adapters)


def w1_prompts(n: int) -> list[str]:
    random.seed(0)
    return [" ".join(random.choice(WORDS) for _ in range(24)) for _ in range(n)]


def bench_engine(
    model: str,
    prompts: list[list[int]],
    new_tokens: int,
    adapters: Sequence[str | None] | None = None,
    passes: int = 1,
    **config: Any,  # EngineConfig's fields
) -> list[tuple[float, float]]:
    """Our engine: all requests added at once, stepped to completion, `passes` times on one engine
    (later passes find their adapters already loaded). Returns (seconds, tok/s) per pass."""
    engine = LLMEngine(EngineConfig(model=model, **{"pool_mb": 256, **config}))
    adapters = adapters or [None] * len(prompts)
    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.warm_up()  # what `loragate engine` runs before it listens (vLLM's LLM warms up in its constructor too)
    results = []
    for k in range(passes):
        engine.scheduler.kv.reset_prefix_cache()  # every pass prefills its prompts for real
        start = time.perf_counter()
        for i, (p, adapter) in enumerate(zip(prompts, adapters, strict=True)):
            engine.add_request(f"p{k}-r{i}", p, params, adapter_id=adapter)
        generated = 0
        while engine.has_unfinished_requests():
            generated += sum(len(o.new_token_ids) for o in engine.step())
        elapsed = time.perf_counter() - start
        assert generated == len(prompts) * new_tokens
        results.append((elapsed, generated / elapsed))
    return results


def bench_hf(model_dir: Path, texts: list[str], new_tokens: int) -> tuple[float, float]:
    """HF transformers batched `generate` (left padding), the same prompts. Returns (seconds, tok/s)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    tok = load_tokenizer(model_dir)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=tok.pad_token_id,
        eos_token_id=None,
    )
    batch = tok(texts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        model.generate(
            **tok(texts[:1], return_tensors="pt"),
            generation_config=GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id),
        )
        start = time.perf_counter()
        out = model.generate(**batch, generation_config=config)
        elapsed = time.perf_counter() - start
    generated = (out.shape[1] - batch["input_ids"].shape[1]) * len(texts)
    return elapsed, generated / elapsed


def w1_adapter_root(model: str, model_dir: Path) -> Path:
    """Where the W1 adapters of a base model are cached: one folder per base, since an adapter fits only the
    shapes of the model it was made on (SmolLM2's keeps the folder it always had)."""
    root = cache_root() / "bench-adapters"
    return root / "w1" if model == "smollm2" else root / f"w1-{model_dir.name}"


def make_w1_adapters(base_dir: Path, root: Path) -> list[Path]:
    """The 8 W1 adapters of the model in `base_dir` (any PEFT-supported causal LM: "all-linear" is q, k, v, o,
    gate, up and down), built once with PEFT into `root` (cached between runs)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    dirs = [root / f"w1-{i}" for i in range(8)]
    if all((d / "adapter_model.safetensors").exists() for d in dirs):
        return dirs
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    for i, d in enumerate(dirs):
        r = [4, 8, 16][i % 3]
        config = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
        model = get_peft_model(copy.deepcopy(base), config)
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
                if ".lora_B." in name:
                    param.copy_(0.02 * torch.randn(param.shape, generator=gen))
        model.save_pretrained(str(d), safe_serialization=True)
    return dirs


def bench_hf_peft(model_dir: Path, adapter_dirs: list[Path], texts: list[str], new_tokens: int) -> tuple[float, float]:
    """HF + PEFT, batched per adapter (each adapter's requests as one `generate`). (seconds, tok/s)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, GenerationConfig

    tok = load_tokenizer(model_dir)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dirs[0]), adapter_name="a0")
    for i, d in enumerate(adapter_dirs[1:], start=1):
        model.load_adapter(str(d), adapter_name=f"a{i}")
    model.eval()
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=tok.pad_token_id,
        eos_token_id=None,
    )
    generated = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(len(adapter_dirs)):
            model.set_adapter(f"a{i}")
            group = [t for k, t in enumerate(texts) if k % len(adapter_dirs) == i]
            batch = tok(group, return_tensors="pt", padding=True)
            out = model.generate(**batch, generation_config=config)
            generated += (out.shape[1] - batch["input_ids"].shape[1]) * len(group)
    elapsed = time.perf_counter() - start
    return elapsed, generated / elapsed


def scale_adapter_dir(weight_dirs: list[Path], root: Path, count: int) -> Path:
    """`count` adapter ids over the 8 weight sets: each id is its own adapter to the engine. Their files are
    hard links (no extra disk), since the engine refuses symlinks that lead out of its --adapter-dir."""
    scale = root / f"scale-{count}-v2"
    scale.mkdir(parents=True, exist_ok=True)
    for k in range(count):
        target = scale / f"a{k:04d}"
        if target.is_dir():
            continue
        target.mkdir()
        for source in weight_dirs[k % len(weight_dirs)].iterdir():
            os.link(source, target / source.name)
    return scale


def zipf_choices(count: int, n: int, s: float = 1.1, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** s for k in range(count)]
    return rng.choices(range(count), weights=weights, k=n)


def bench_lora(
    args: argparse.Namespace, resolved, prompts: list[list[int]], texts: list[str], base_tps: float
) -> dict[str, Any]:
    """Mixed LoRA, the scale passes and HF + PEFT; returns their figures (`mixed` and `scale`)."""
    root = cache_root() / "bench-adapters"
    weight_dirs = make_w1_adapters(resolved.path, w1_adapter_root(args.model, resolved.path))
    scale_root = root if args.model == "smollm2" else root / resolved.path.name  # hard links to this base's adapters
    names = [d.name for d in weight_dirs]
    mixed = [names[i % 8] for i in range(len(prompts))]
    [(secs, lora)] = bench_engine(
        args.engine_model, prompts, args.new_tokens, mixed, adapter_dir=str(weight_dirs[0].parent), dtype=args.dtype
    )
    print(
        f"loragate mixed LoRA    {lora:7.1f} tok/s  ({secs:.2f} s)  LoRA/base {lora / base_tps:.2f}"
        "  (target >= 80 tok/s, >= 0.85)"
    )
    figures: dict[str, Any] = {
        "mixed": {"loragate_tok_s": lora, "loragate_s": secs, "lora_base_ratio": lora / base_tps},
        "scale": [],
    }
    for count in args.scale_counts:
        scale_dir = scale_adapter_dir(weight_dirs, scale_root, count)
        ids = [f"a{k:04d}" for k in zipf_choices(count, len(prompts))]
        cold, warm = bench_engine(
            args.engine_model,
            prompts,
            args.new_tokens,
            ids,
            passes=2,
            adapter_dir=str(scale_dir),
            max_device_adapters=SCALE_TIER,
            pool_mb=1024,
            dtype=args.dtype,
        )
        for label, (secs, scale) in (("cold", cold), ("warm", warm)):
            print(
                f"loragate {count} adapters  {scale:7.1f} tok/s  ({secs:.2f} s)  {label}: {len(set(ids))} "
                f"distinct in the batch, device tier {SCALE_TIER}, Zipf  drop vs 8 adapters "
                f"{100 * (1 - scale / lora):.1f}%  (target <= 10%)",
                flush=True,
            )
        figures["scale"].append(
            {
                "adapters": count,
                "device_tier": SCALE_TIER,
                "distinct_in_batch": len(set(ids)),
                "cold_tok_s": cold[1],
                "warm_tok_s": warm[1],
            }
        )
    if not args.skip_hf:
        secs, hf = bench_hf_peft(resolved.path, weight_dirs, texts, args.new_tokens)
        print(f"HF + PEFT per adapter  {hf:7.1f} tok/s  ({secs:.2f} s)  loragate/HF+PEFT {lora / hf:.2f}x")
        figures["mixed"].update(hf_peft_tok_s=hf, hf_peft_s=secs)
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16", "auto"), help="the engine's (HF rows: fp32)"
    )
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-lora", action="store_true")
    ap.add_argument(
        "--scale-counts",
        type=lambda v: [int(c) for c in v.split(",") if c],
        default=[512],
        help="registered-adapter counts of the scale passes, comma-separated (empty: none)",
    )
    ap.add_argument("--json", type=Path, help="also write the figures here as one JSON object")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    args.engine_model = model_spec(args.model)  # what the engine loads: a shaped model's directory, else the name
    resolved = resolve_model(args.engine_model)
    tok = load_tokenizer(resolved.path)
    texts = w1_prompts(args.requests)
    prompts = [tok(t)["input_ids"] for t in texts]
    mean_len = sum(map(len, prompts)) / len(prompts)
    figures: dict[str, Any] = {
        "config": {
            "model": args.model,
            "requests": args.requests,
            "new_tokens": args.new_tokens,
            "threads": args.threads,
            "dtype": args.dtype,
            "mean_prompt_tokens": mean_len,
        }
    }
    print(
        f"W1 base: {args.requests} requests, {mean_len:.1f} prompt tokens on average, "
        f"{args.new_tokens} new tokens each, {args.dtype}, {args.threads} threads"
    )
    [(secs, ours)] = bench_engine(args.engine_model, prompts, args.new_tokens, dtype=args.dtype)
    print(f"loragate engine        {ours:7.1f} tok/s  ({secs:.2f} s)")
    figures["base"] = {"loragate_tok_s": ours, "loragate_s": secs}
    if not args.skip_hf:
        secs, hf = bench_hf(resolved.path, texts, args.new_tokens)
        print(f"HF transformers batch  {hf:7.1f} tok/s  ({secs:.2f} s)")
        print(f"ratio loragate / HF    {ours / hf:7.2f}x")
        figures["base"].update(hf_tok_s=hf, hf_s=secs)
    if not args.skip_lora:
        figures.update(bench_lora(args, resolved, prompts, texts, ours))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
