"""Kernels: batched LoRA (Triton `sgmv.py`, the CPU's C++ op `cpu_lora.cpp`, and the pure-torch twins in
`reference.py`, which are the test oracle and the CPU path where the C++ ops cannot be built) and paged decode
attention (Triton `paged_attention.py`, the CPU's C++ op `cpu_attention.cpp`; the torch path is in
engine/model/attention.py), and a decoder layer's fused elementwise ops on the CPU (`cpu_layer.cpp`; the torch
twins are in engine/model/layer_ops.py), the CPU's fp32 GEMM for few rows (`cpu_gemm.cpp`) and its bf16 GEMM over a
tile layout, on AMX tiles or the bf16 dot instruction (`cpu_amx.cpp`; F.linear is the twin of both).
`cpu_ops.py` builds the C++ ops.

`lora_backend(device)` and `attention_backend(device)` are the seams: "triton" for CUDA tensors; for CPU ones "cpp"
where loragate_kernels/cpu_ops.py could build its ops, else "torch". The environment variables LORAGATE_LORA_BACKEND and
LORAGATE_ATTENTION_BACKEND (torch|triton|cpp) force one: the tests run the Triton kernels on CPU tensors this way,
under Triton's interpreter (loragate_kernels/triton_jit.py), and the torch paths. `layer_backend(device)` is the seam of
the layer ops and the sampler's greedy pick ("cpp" or "torch"; CUDA runs torch's; LORAGATE_LAYER_BACKEND forces one).
`gemm_backend(device)` is the seam of the CPU path's projections and LM head (engine/model/cpu_gemm.py): "cpp"
(fp32: `cpu_gemm.cpp` for decode-sized row counts, oneDNN above; bf16: `cpu_amx.cpp` where the CPU has AMX or
avx512_bf16, else oneDNN-prepacked weights), "onednn" (oneDNN-prepacked weights) or "torch" (plain
F.linear, CUDA's); LORAGATE_GEMM_BACKEND forces one. Importing triton is left to the caller that needs it.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("torch", "triton", "cpp")


def _forced(variable: str, choices: tuple[str, ...]) -> str:
    """The backend the environment variable forces ("" for none), refused when it is not one of `choices` or is
    "cpp" where the C++ ops cannot be built."""
    from loragate_kernels import cpu_ops

    forced = os.environ.get(variable, "").strip().lower()
    if forced and forced not in choices:
        raise ValueError(f"{variable} must be one of {', '.join(choices)}, not {forced!r}")
    if forced == "cpp" and not cpu_ops.load():
        raise ValueError(f"{variable}=cpp, but the CPU ops cannot be built: {cpu_ops.unavailable_reason()}")
    return forced


def _backend(variable: str, device: torch.device, gpu: str = "triton", choices: tuple[str, ...] = BACKENDS) -> str:
    """The backend `variable` forces; else `gpu` on CUDA, on a CPU "cpp" where the C++ ops build, else "torch"."""
    from loragate_kernels import cpu_ops

    forced = _forced(variable, choices)
    if forced:
        return forced
    if torch.device(device).type == "cuda":
        return gpu
    return "cpp" if cpu_ops.load() else "torch"


def lora_backend(device: torch.device) -> str:
    """How LoRA deltas are computed for tensors on `device` (on a CPU this may build the C++ ops, once)."""
    return _backend("LORAGATE_LORA_BACKEND", device)


def attention_backend(device: torch.device) -> str:
    """How decodes attend over the paged cache for tensors on `device`."""
    return _backend("LORAGATE_ATTENTION_BACKEND", device)


def layer_backend(device: torch.device) -> str:
    """How a decoder layer's norms, RoPE and activation run (engine/model/layer_ops.py), and the sampler's greedy
    pick (engine/worker/sampler.py): "cpp" on a CPU where the C++ ops build, else "torch" (CUDA included);
    LORAGATE_LAYER_BACKEND=torch|cpp forces one."""
    return _backend("LORAGATE_LAYER_BACKEND", device, gpu="torch", choices=("torch", "cpp"))


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


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def gemm_backend(device: torch.device) -> str:
    """How the projections and the LM head multiply on `device` (engine/model/cpu_gemm.py): on a CPU with AVX2 and
    FMA (AVX-512 ones included) where the C++ ops build, "cpp" (fp32 GEMMs on loragate_kernels/cpu_panels.cpp at
    every row count where the CPU has AVX-512; else on cpu_gemm.cpp up to engine/model/cpu_gemm.py SKINNY_ROWS rows:
    decode steps stream every weight from memory, and there it outran oneDNN's kernels, ~1.3x on an AVX2 EPYC, and
    oneDNN over the same row-major weight above; bf16 weights on loragate_kernels/cpu_amx.cpp where the CPU has AMX
    or avx512_bf16, else oneDNN-packed where oneDNN packs bf16); "onednn" (oneDNN-prepacked weights) on other CPUs
    with oneDNN; else "torch" (plain F.linear; CUDA). LORAGATE_GEMM_BACKEND=torch|onednn|cpp forces one ("onednn"
    on a torch without oneDNN is refused)."""
    from loragate_kernels import cpu_ops

    forced = _forced("LORAGATE_GEMM_BACKEND", ("torch", "onednn", "cpp"))
    if forced == "onednn" and not onednn_available():
        raise ValueError("LORAGATE_GEMM_BACKEND=onednn, but this torch has no oneDNN")
    if forced:
        return forced
    if torch.device(device).type != "cpu":
        return "torch"
    if {"avx2", "fma"} <= cpu_flags() and cpu_ops.load():
        return "cpp"
    return "onednn" if onednn_available() else "torch"
