"""Every server a test starts, on 127.0.0.1: `loragate engine` / `loragate gateway` processes, and ASGI apps
under uvicorn in a thread (the mock upstream, an app under test). One launcher for all of them."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from loragate.launch import LaunchError, launch, stop

from polling import poll

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_loragate(
    log_path: Path, *args: str, timeout_s: float = 120.0, port: int | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """`python -m loragate ARGS... --port PORT` (a free one by default; engine or gateway), once its
    /healthz answers 200. The log is appended to, so a restart on the same port keeps the earlier lines."""
    port = port if port is not None else free_port()
    argv = [sys.executable, "-m", "loragate", *args, "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "ab") as log:
        try:
            proc = launch(
                argv,
                base,
                timeout_s=timeout_s,
                name=f"`loragate {args[0]}`",
                env=env,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        except LaunchError as exc:
            pytest.fail(f"`loragate {args[0]}` did not come up ({exc}):\n{log_path.read_text()[-3000:]}")
    return proc, base


def start_engine_server(
    log_path: Path,
    *args: str,
    model: str = "tiny-random",
    timeout_s: float = 120.0,
    port: int | None = None,
    warmup: bool = False,
) -> tuple[subprocess.Popen[bytes], str]:
    """`python -m loragate engine --model MODEL --port FREE --threads 1 [--dtype float32] ARGS...`; (process, base
    URL). float32 unless ARGS name a dtype: tests compare outputs with fp32 references, and `auto` differs between
    CPUs (engine/model/cpu_gemm.py auto_cpu_dtype). Without the warm-up unless `warmup` (it costs seconds a start,
    and tests start many engines; tests/engine/test_server.py starts one with it)."""
    warmup_args = () if warmup else ("--no-warmup",)
    dtype = () if "--dtype" in args else ("--dtype", "float32")
    return start_loragate(
        log_path,
        "engine",
        "--model",
        model,
        "--threads",
        "1",
        *dtype,
        *warmup_args,
        *args,
        timeout_s=timeout_s,
        port=port,
    )


def start_gateway(
    tmp_path: Path, name: str, policy: str, upstreams: list[str], *extra: str
) -> tuple[subprocess.Popen[bytes], str]:
    """`loragate gateway` with `policy` written to TMP/NAME.yaml and its log in TMP/NAME.log."""
    policy_path = tmp_path / f"{name}.yaml"
    policy_path.write_text(policy)
    args = ["gateway", "--policy", str(policy_path), "--log-level", "warning", *extra]
    for upstream in upstreams:
        args += ["--upstream", upstream]
    return start_loragate(tmp_path / f"{name}.log", *args, timeout_s=30)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    stop(proc, grace_s=15)


@contextlib.contextmanager
def serve_in_thread(
    app: Any, log_level: str = "warning", host: str = "127.0.0.1", port: int = 0, **config: Any
) -> Iterator[str]:
    """Run an ASGI `app` under uvicorn in a daemon thread on `host`:`port` (a free port by default; any
    127.0.0.x is loopback); yields its base URL."""
    sock = socket.socket()
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, http="h11", **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        poll(lambda: server.started, 10, interval_s=0.01, what="uvicorn started")
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
