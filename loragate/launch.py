"""Start a server process and wait until it is healthy (GET /healthz answers 200), and stop it again.

`loragate up`, the benchmarks and the tests all start engines and gateways this way. Only the standard
library: the gateway's install profile has no torch, and this must not pull anything in either.
"""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO


class LaunchError(RuntimeError):
    """The process exited, or did not become healthy in time."""


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    """Whether GET {url}/healthz answers 200 now."""
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=timeout_s) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(
    url: str,
    process: subprocess.Popen[bytes] | None = None,
    *,
    timeout_s: float,
    interval_s: float = 0.2,
    name: str | None = None,
) -> None:
    """Return once {url}/healthz answers 200; LaunchError if `process` exits first or `timeout_s` passes."""
    what = name or url
    deadline = time.monotonic() + timeout_s
    while not healthy(url):
        if process is not None and process.poll() is not None:
            raise LaunchError(f"{what} exited with status {process.returncode}")
        if time.monotonic() > deadline:
            raise LaunchError(f"{what} did not become healthy within {timeout_s:.0f} s")
        time.sleep(interval_s)


def launch(
    argv: Sequence[str],
    url: str,
    *,
    timeout_s: float,
    name: str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    stdout: IO[bytes] | int | None = None,
    stderr: IO[bytes] | int | None = None,
) -> subprocess.Popen[bytes]:
    """Start `argv` and wait until it serves `url` (see `wait_healthy`); on any failure it is stopped first."""
    process = subprocess.Popen(list(argv), env=env, cwd=cwd, stdout=stdout, stderr=stderr)
    try:
        wait_healthy(url, process, timeout_s=timeout_s, name=name or Path(argv[0]).name)
    except BaseException:
        stop(process, grace_s=5.0)
        raise
    return process


def stop(process: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGTERM, wait up to `grace_s`, then SIGKILL; returns once the process is gone."""
    if process.poll() is None:
        process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
