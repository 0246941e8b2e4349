"""The CPU path's batched LoRA as a C++ op (kernels/cpu_lora.cpp): one call per module group and layer serves
every segment of a step, reading A and B.T straight from the page pool through the device tier's slot tables.

Why C++: a step of 32 decodes over 8 adapters is, on SmolLM2, ~2,600 tiny matmuls per step as torch ops
(`lora_sgmv_group`, the twin), and ~330 batched ones over per-step weight copies padded to the step's largest
rank (engine/lora/stacks.py). Either way the cost is dispatch, conversions and the padded copies' bytes, not
FLOPs. The op reads each adapter's weights once, unpadded, in the model's dtype (half of fp32's bytes in bf16),
with fp32 products and sums (`python bench/lora_kernels.py --cpu-op` compares the three).

`load()` builds the op the first time a process asks (torch.utils.cpp_extension with ninja and the system C++
compiler, ~10-20 s on 2 cores; later processes reuse the build), for this CPU (`-march=native`; the build's name
carries a digest of the CPU's flags so a build directory shared by different CPUs never runs the wrong one).
Where it cannot be built (no compiler, as in the slim engine image), `load()` returns False once with the reason
logged, and the engine keeps the torch path (kernels/__init__.py `lora_backend`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kernels.sgmv import GroupTables

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_lora.cpp")
_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "reason": str


def _build_name() -> str:
    from engine.model.cpu_gemm import cpu_flags

    digest = hashlib.blake2b(SOURCE.read_bytes(), digest_size=6)
    digest.update(" ".join(sorted(cpu_flags())).encode())
    digest.update(torch.__version__.encode())
    return f"loragate_cpu_lora_{digest.hexdigest()}"


def load() -> bool:
    """Build (or reuse) and register `torch.ops.loragate_cpu.lora_sgmv_group`; False where it cannot be built."""
    with _lock:
        if "ok" not in _state:
            _state["ok"], _state["reason"] = _build()
            if not _state["ok"]:
                logger.warning("CPU LoRA op unavailable, the torch path serves LoRA: %s", _state["reason"])
        return bool(_state["ok"])


def unavailable_reason() -> str | None:
    """Why `load()` returned False (None before it ran or when it succeeded)."""
    return None if _state.get("ok", True) else str(_state["reason"])


def _build() -> tuple[bool, str]:
    if os.environ.get("LORAGATE_CPU_OPS", "1").strip() == "0":
        return False, "LORAGATE_CPU_OPS=0"
    try:
        from torch.utils.cpp_extension import load as load_extension

        build_dir = os.environ.get("LORAGATE_TORCH_EXTENSIONS")
        if build_dir:
            Path(build_dir).mkdir(parents=True, exist_ok=True)
        load_extension(
            name=_build_name(),
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            # libgomp.so.1 resolves to the copy torch already loaded: one OpenMP runtime, torch's thread count
            extra_ldflags=["-fopenmp"],
            build_directory=build_dir,
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler or ninja, a failed build: the torch path serves instead
        return False, f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    return True, ""


def lora_sgmv_group_cpu(
    y: torch.Tensor,
    x: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    pool: torch.Tensor,
    tables: GroupTables,
    out_cols: Sequence[int],
) -> None:
    """y += the group's LoRA deltas for every segment, in place: kernels/reference.py `lora_sgmv_group`'s result
    (the oracle; sums in another order), with the index tables as the device tier's int64 tensors.

    Shapes:
        y:          [T, out_cols[-1]]  columns contiguous, rows any stride; fp32, bf16 or fp16 like x and pool
        x:          [T, in_features]   columns contiguous
        seg_starts: [S + 1] int64;  seg_slots: [S] int64 (segments with no rows, or a rank-0 slot, are skipped)
        pool:       [N]                one layer's pool, contiguous
        tables:     a_offsets [slots], ranks / b_offsets / h_cols [M, slots], rank_total [slots], all int64
        out_cols:   [M + 1]            the modules' column boundaries in y
    Raises RuntimeError on inconsistent arguments (a table entry past the pool, a slot out of range).
    """
    torch.ops.loragate_cpu.lora_sgmv_group(
        y,
        x,
        seg_starts,
        seg_slots,
        pool,
        tables.a_offsets,
        tables.ranks,
        tables.b_offsets,
        tables.h_cols,
        tables.rank_total,
        out_cols,
    )
