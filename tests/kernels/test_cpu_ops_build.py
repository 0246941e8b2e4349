"""Building the CPU ops survives a build that was stopped half-way (loragate_kernels/cpu/build.py `build_lock`).

torch's extension builder guards a build directory with a file (torch.utils.file_baton.FileBaton: `lock`) that only
a build that finishes removes; a process killed mid-build left it, and every later `load()` waited on it forever.
Each test runs real interpreters: one killed while it holds torch's baton, then a fresh one that must load the ops.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from loragate_kernels.cpu import build as cpu_ops

REPO = Path(__file__).resolve().parents[2]


def python(code: str, env: dict[str, str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


def wait_for_line(proc: subprocess.Popen, expected: str) -> None:
    line = proc.stdout.readline()
    assert line.strip() == expected, line + proc.stdout.read()


def test_a_build_killed_holding_torchs_lock_does_not_block_the_next_start(tmp_path: Path) -> None:
    if not cpu_ops.load():
        pytest.skip(f"the CPU ops do not build here: {cpu_ops.unavailable_reason()}")
    build = tmp_path / "ext"
    shutil.copytree(cpu_ops.build_directory(), build)  # this build, up to date: the next load builds nothing
    env = {"LORAGATE_TORCH_EXTENSIONS": str(build)}
    # a build stopped half-way: the process holds torch's baton for the directory when it is killed
    holder = python(
        f"""
        import time
        from torch.utils.file_baton import FileBaton
        assert FileBaton({str(build / "lock")!r}).try_acquire()
        print("holding", flush=True)
        time.sleep(600)
        """,
        env,
    )
    wait_for_line(holder, "holding")
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    assert (build / "lock").exists()
    start = python("from loragate_kernels.cpu import build; print(build.load(), flush=True)", env)
    try:
        out, _ = start.communicate(timeout=240)
    finally:
        start.kill()
    assert start.returncode == 0, out
    assert out.strip().splitlines()[-1] == "True", out
    assert "left by a build of the CPU ops that was stopped" in out
    assert not (build / "lock").exists()


def test_a_live_build_is_waited_for_and_its_lock_left_alone(tmp_path: Path) -> None:
    build = tmp_path / "ext"
    env = {"LORAGATE_TORCH_EXTENSIONS": str(build)}
    # one process builds: it holds build_lock and torch's `lock` file for 2 s, then finishes (removing the file)
    builder = python(
        f"""
        import time
        from pathlib import Path
        from loragate_kernels.cpu.build import build_lock
        with build_lock(Path({str(build)!r})):
            (Path({str(build)!r}) / "lock").touch()
            print("building", flush=True)
            time.sleep(2)
            (Path({str(build)!r}) / "lock").unlink()
            print("built", time.time(), flush=True)
        """,
        env,
    )
    wait_for_line(builder, "building")
    # a second process asks for the lock meanwhile: it must wait for the first, never take its live `lock` away
    waiter = python(
        f"""
        import logging, time
        from pathlib import Path
        from loragate_kernels.cpu.build import build_lock
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        with build_lock(Path({str(build)!r})):
            print("acquired", time.time(), flush=True)
        """,
        env,
    )
    try:
        built, _ = builder.communicate(timeout=60)
        waited, _ = waiter.communicate(timeout=60)
    finally:
        builder.kill()
        waiter.kill()
    assert builder.returncode == 0 and waiter.returncode == 0, built + waited
    built_at = float(built.split("built", 1)[1].split()[0])
    acquired_at = float(waited.split("acquired", 1)[1].split()[0])
    assert acquired_at >= built_at, (built, waited)
    assert "waiting for another process's build" in waited
    assert "left by a build" not in waited  # the builder's lock was gone when the waiter got in: nothing to remove
    assert time.time() - built_at < 60
