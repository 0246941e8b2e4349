"""Builds the CPU path's C++ ops once per machine and registers them as `torch.ops.loragate_cpu.*`
(loragate_kernels/cpu/ops.py documents each op; loragate_kernels/backends.py decides where they run).

The sources: batched LoRA (`lora.cpp`), paged decode attention (`attention.cpp`), a decoder layer's fused
elementwise ops (`layer.cpp`: RMSNorm with the residual add, SiLU-and-mul, RoPE with the K/V cache write), the greedy
pick (`sampling.cpp`), the GEMMs (`panels.cpp` for fp32 on AVX-512, `gemm.cpp` for fp32 on AVX2, `amx.cpp` for bf16
on AMX tiles or the bf16 dot instruction) and the greedy screen of a wide fp32 LM head (`screen.cpp`), with
`common.h` (vector helpers) and `lora.h` (the LoRA op's entry, which every GEMM's fused twin calls on its output).

`load()` builds the ops the first time a process asks (torch.utils.cpp_extension with ninja and the system C++
compiler, ~20 s on 2 cores; later processes reuse the build), for this CPU (`-march=native`; the build's name
carries a digest of the sources, the CPU's flags and torch's version, so a build directory shared by different
CPUs never runs the wrong one). LORAGATE_TORCH_EXTENSIONS sets where builds go; `build_lock` keeps a build that was
stopped half-way from blocking every later one. Where they cannot be built (no compiler, as in the slim engine
image; `CXX=/bin/false`), `load()` returns False once with the reason logged, and loragate_kernels/backends.py picks
the torch routes. LORAGATE_CPU_OPS=0 skips the build on purpose.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "lora.cpp",
        "attention.cpp",
        "layer.cpp",
        "sampling.cpp",
        "gemm.cpp",
        "amx.cpp",
        "panels.cpp",
        "screen.cpp",
    )
]
HEADERS = [Path(__file__).with_name(name) for name in ("common.h", "lora.h")]
# -fno-trapping-math lets GCC vectorize the float -> int conversion in the ops' e^x (no value changes).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math"]
_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "reason": str


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (empty where there is no /proc/cpuinfo)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def _build_name() -> str:
    digest = hashlib.blake2b(b"".join(source.read_bytes() for source in SOURCES + HEADERS), digest_size=6)
    digest.update(" ".join(sorted(cpu_flags())).encode())
    digest.update(" ".join([torch.__version__, *CFLAGS]).encode())
    return f"loragate_cpu_ops_{digest.hexdigest()}"


def load() -> bool:
    """Build (or reuse) and register `torch.ops.loragate_cpu.*`; False where they cannot be built."""
    with _lock:
        if "ok" not in _state:
            _state["ok"], _state["reason"] = _build()
            if not _state["ok"]:
                logger.warning("the CPU ops cannot be built, the torch routes serve instead: %s", _state["reason"])
        return bool(_state["ok"])


def unavailable_reason() -> str | None:
    """Why `load()` returned False (None before it ran or when it succeeded)."""
    return None if _state.get("ok", True) else str(_state["reason"])


def build_directory() -> Path:
    """Where the build's files go: LORAGATE_TORCH_EXTENSIONS, else torch's own folder for the build's name."""
    configured = os.environ.get("LORAGATE_TORCH_EXTENSIONS")
    if configured:
        return Path(configured)
    from torch.utils import cpp_extension

    torch_folder = getattr(cpp_extension, "_get_build_directory", None)  # private: fall back to its documented root
    if torch_folder is not None:
        return Path(torch_folder(_build_name(), False))
    return Path(cpp_extension.get_default_build_root()) / _build_name()


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Held while this process builds into `build_dir`: an flock, which the kernel drops when its holder exits,
    however it exits. torch's own lock is a file (`lock` in the build directory) that only a build that finishes
    removes: a process stopped mid-build (a pod killed during its first start, `make serve` interrupted) left it
    behind, and every later start waited on it forever. Under this lock no other loragate build runs, so a `lock` file
    found is such a leftover, and goes."""
    import fcntl

    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "loragate-build.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process's build of the CPU ops in %s", build_dir)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            leftover = build_dir / "lock"
            if leftover.exists():
                logger.warning("removing %s, left by a build of the CPU ops that was stopped", leftover)
                leftover.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build() -> tuple[bool, str]:
    if os.environ.get("LORAGATE_CPU_OPS", "1").strip() == "0":
        return False, "LORAGATE_CPU_OPS=0"
    try:
        from torch.utils.cpp_extension import load as load_extension

        build_dir = build_directory()
        with build_lock(build_dir):
            load_extension(
                name=_build_name(),
                sources=[str(source) for source in SOURCES],
                extra_cflags=CFLAGS,
                # libgomp.so.1 resolves to the copy torch already loaded: one OpenMP runtime, torch's thread count
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
    except Exception as exc:  # no compiler or ninja, a failed build: the torch path serves instead
        return False, f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    return True, ""
