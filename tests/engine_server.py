"""Start real `loragate engine` / `loragate gateway` processes on 127.0.0.1 for HTTP tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_engine_server(log_path: Path, *args: str, model: str = "tiny-random", timeout_s: float = 120.0,
                        port: int | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """`python -m loragate engine --model MODEL --port FREE --threads 1 ARGS...`; (process, base URL)."""
    return start_loragate(log_path, "engine", "--model", model, "--threads", "1", *args,
                          timeout_s=timeout_s, port=port)


def start_loragate(log_path: Path, *args: str, timeout_s: float = 120.0, port: int | None = None
                   ) -> tuple[subprocess.Popen[bytes], str]:
    """`python -m loragate ARGS... --port PORT` (a free one by default; engine or gateway), once its
    /healthz answers 200. The log is appended to, so a restart on the same port keeps the earlier lines."""
    port = port if port is not None else free_port()
    argv = [sys.executable, "-m", "loragate", *args, "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"`loragate {args[0]}` did not come up:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.2)
