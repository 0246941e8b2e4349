"""The CPU path's C++ ops, built once per machine: batched LoRA (loragate_kernels/cpu_lora.cpp), paged decode attention
(loragate_kernels/cpu_attention.cpp), a decoder layer's fused elementwise ops (loragate_kernels/cpu_layer.cpp: RMSNorm
with the residual add, SiLU-and-mul, RoPE with the K/V cache write), the greedy pick
(loragate_kernels/cpu_sampling.cpp) and the GEMMs (loragate_kernels/cpu_panels.cpp for fp32 on AVX-512, cpu_gemm.cpp
for fp32 on AVX2, cpu_amx.cpp for bf16 on AMX tiles or the bf16 dot instruction), registered as
`torch.ops.loragate_cpu.*`. Each GEMM has a twin with a LoRA group fused (`panel_linear_lora`,
`skinny_linear_lora`, `amx_linear_lora`: the GEMM, then the LoRA op on its output, in one call;
engine/model/cpu_gemm.py PackedLinear `fused_lora`), which saves a step 120 calls into the dispatcher.

Why C++: a step of 32 decodes over 8 adapters is, on SmolLM2, ~2,600 tiny matmuls per step as torch ops
(`lora_sgmv_group`, the twin), and ~330 batched ones over per-step weight copies padded to the step's largest
rank (engine/lora/stacks.py). Either way the cost is dispatch, conversions and the padded copies' bytes, not
FLOPs. The LoRA op reads each adapter's weights once, unpadded, in the model's dtype (half of fp32's bytes in
bf16), with fp32 products and sums. Decode attention in torch gathers every sequence's context into a batch-shaped
copy per layer, then runs five ops over it; the attention op reads K and V through the block tables where they lie.
Around the GEMMs, a layer in torch is ~20 small ops (RMSNorm alone is six on a CPU), each a dispatch and a
tensor; the layer ops make it five passes over the rows (engine/model/layer_ops.py).
`python bench/lora_cost.py` and `python bench/step_profile.py` measure both in a W1 step.

`load()` builds the ops the first time a process asks (torch.utils.cpp_extension with ninja and the system C++
compiler, ~20 s on 2 cores; later processes reuse the build), for this CPU (`-march=native`; the build's name
carries a digest of the sources, the CPU's flags and torch's version, so a build directory shared by different
CPUs never runs the wrong one; LORAGATE_TORCH_EXTENSIONS sets where builds go; `build_lock` keeps a build that was
stopped half-way from blocking every later one). Where they cannot be built (no
compiler, as in the slim engine image), `load()` returns False once with the reason logged, and the engine keeps
its torch paths (loragate_kernels/__init__.py `lora_backend`, `attention_backend`). LORAGATE_CPU_OPS=0 skips the build.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from loragate_kernels.sgmv import GroupTables

logger = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "cpu_lora.cpp",
        "cpu_attention.cpp",
        "cpu_layer.cpp",
        "cpu_sampling.cpp",
        "cpu_gemm.cpp",
        "cpu_amx.cpp",
        "cpu_panels.cpp",
    )
]
HEADERS = [Path(__file__).with_name(name) for name in ("cpu_common.h", "cpu_lora.h")]
# -fno-trapping-math lets GCC vectorize the float -> int conversion in the ops' e^x (no value changes).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math"]
_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "reason": str


def _build_name() -> str:
    from loragate_kernels import cpu_flags

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
                logger.warning("CPU ops unavailable, the torch paths serve LoRA and attention: %s", _state["reason"])
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


def lora_sgmv_group_cpu(
    y: torch.Tensor,
    x: torch.Tensor,
    segments: torch.Tensor,
    pool: torch.Tensor,
    block: torch.Tensor,
    out_cols: Sequence[int],
) -> None:
    """y += the group's LoRA deltas for every segment, in place: loragate_kernels/reference.py `lora_sgmv_group`'s
    result (the oracle; sums in another order), with the index tables as one block of the device tier's table.

    Shapes:
        y:        [T, out_cols[-1]]  columns contiguous, rows any stride; fp32, bf16 or fp16 like x and pool
        x:        [T, in_features]   columns contiguous
        segments: [2 S + 1] int64    the S + 1 segment starts, then the S slots (segments with no rows, or a
                                     rank-0 slot, are skipped)
        pool:     [N]                one layer's pool, contiguous
        block:    [2 + 3 M, slots]   int64, contiguous: a_offsets, ranks[M], b_offsets[M], h_cols[M], rank_total
                                     (`pack_tables`; M >= the group's modules, which use the first rows)
        out_cols: [modules + 1]      the modules' column boundaries in y
    Raises RuntimeError on inconsistent arguments (a table entry past the pool, a slot out of range).
    """
    torch.ops.loragate_cpu.lora_sgmv_group(y, x, segments, pool, block, out_cols)


def pack_tables(tables: GroupTables, modules: int | None = None) -> torch.Tensor:
    """A group's tables as the op's block [2 + 3 M, slots] int64 (M = `modules`, default the tables' own)."""
    m = tables.ranks.shape[0] if modules is None else modules
    block = torch.zeros(2 + 3 * m, tables.a_offsets.numel(), dtype=torch.int64)
    n = tables.ranks.shape[0]
    block[0] = tables.a_offsets
    block[1 : 1 + n] = tables.ranks
    block[1 + m : 1 + m + n] = tables.b_offsets
    block[1 + 2 * m : 1 + 2 * m + n] = tables.h_cols
    block[1 + 3 * m] = tables.rank_total
    return block


def paged_decode_attention_cpu(
    q: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor
) -> torch.Tensor:
    """One-token attention of every decode sequence over its context in one layer's paged KV cache: the semantics
    of loragate_kernels/paged_attention.py `paged_decode_attention` (the Triton kernel; the new token's K/V must already
    be in the cache), on CPU tensors.

    Shapes:
        q:             [D, num_heads, hd]                             head dim contiguous
        layer_cache:   [num_pages, 2, block_size, num_kv_heads, hd]   q's dtype (fp32, bf16 or fp16)
        block_tables:  [D, W] int64, W >= ceil(max(context_lens) / block_size); entries past a row's length unread
        context_lens:  [D] int64 (a row with 0 gets zeros)
        returns        [D, num_heads, hd], a new tensor
    Raises RuntimeError on a table entry that is not a page, or a length past its table.
    """
    scale = q.shape[-1] ** -0.5
    return torch.ops.loragate_cpu.paged_decode_attention(q, layer_cache, block_tables, context_lens, scale)


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, n] (columns contiguous) -> x * rsqrt(mean(x^2) + eps) * weight, a new [T, n]; fp32 inside, rounded
    once to x's dtype."""
    return torch.ops.loragate_cpu.rms_norm(x, weight, eps)


def add_rms_norm_cpu(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x in place (rounded to its dtype), then `rms_norm_cpu(residual, ...)`: the residual stream's
    add fused with the next norm. Both [T, n] of one dtype."""
    return torch.ops.loragate_cpu.add_rms_norm(residual, x, weight, eps)


def silu_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate | up) -> silu(gate) * up, a new [T, I]; fp32 inside, rounded once."""
    return torch.ops.loragate_cpu.silu_mul(gate_up)


def rope_write_kv_cpu(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layer_cache: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    num_heads: int,
) -> None:
    """Rotate qkv's q and k heads in place (x * cos + roll(x, hd/2) * sin, engine/model/llama.py `apply_rope`; fp32
    inside, rounded once), then write each token's k and v into the cache rows k_rows / v_rows.

    Shapes:
        qkv:          [T, (num_heads + 2 * kvh) * hd]  q | k | v, columns contiguous
        cos, sin:     [T, 1, hd] or [T, hd] float32, contiguous (engine/model/llama.py `RotaryEmbedding`)
        layer_cache:  [num_pages, 2, block_size, kvh, hd] contiguous, qkv's dtype
        k_rows, v_rows: [T] int64 rows of the cache viewed as [rows, kvh, hd] (engine/model/attention.py `key_rows`)
    Raises RuntimeError on a row outside the cache (checked before anything is written).
    """
    torch.ops.loragate_cpu.rope_write_kv(qkv, cos, sin, layer_cache, k_rows, v_rows, num_heads)


def greedy_rows_cpu(logits: torch.Tensor, banned: torch.Tensor, non_finite: int, no_token: int) -> list[int]:
    """Each row's first maximal index over the columns not in `banned`, in one pass: `non_finite` for a row with
    a NaN or infinite logit (banned columns included), `no_token` where every column is banned.

    Shapes:
        logits: [B, V]  fp32, bf16 or fp16, columns contiguous, rows any stride
        banned: [n]     int64 column ids within [0, V) (duplicates allowed); empty for none
    Raises RuntimeError on a banned id outside the vocabulary.
    """
    return torch.ops.loragate_cpu.greedy_rows(logits, banned, non_finite, no_token).tolist()
