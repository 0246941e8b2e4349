"""Kernels: batched LoRA (Triton `sgmv.py`, the CPU's C++ op `cpu_lora.cpp`, and the pure-torch twins in
`reference.py`, which are the test oracle and the CPU path where the C++ ops cannot be built) and paged decode
attention (Triton `paged_attention.py`, the CPU's C++ op `cpu_attention.cpp`; the torch path is in
engine/model/attention.py). `cpu_ops.py` builds the C++ ops.

`lora_backend(device)` and `attention_backend(device)` are the seams: "triton" for CUDA tensors; for CPU ones "cpp"
where kernels/cpu_ops.py could build its ops, else "torch". The environment variables LORAGATE_LORA_BACKEND and
LORAGATE_ATTENTION_BACKEND (torch|triton|cpp) force one: the tests run the Triton kernels on CPU tensors this way,
under Triton's interpreter (kernels/triton_jit.py), and the torch paths. Importing triton is left to the caller
that needs it.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("torch", "triton", "cpp")


def _backend(variable: str, device: torch.device) -> str:
    """The backend `variable` forces; else "triton" on CUDA, on a CPU "cpp" where the C++ ops build, else "torch"."""
    from kernels import cpu_ops

    forced = os.environ.get(variable, "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"{variable} must be one of {', '.join(BACKENDS)}, not {forced!r}")
        if forced == "cpp" and not cpu_ops.load():
            raise ValueError(f"{variable}=cpp, but the CPU ops cannot be built: {cpu_ops.unavailable_reason()}")
        return forced
    if torch.device(device).type == "cuda":
        return "triton"
    return "cpp" if cpu_ops.load() else "torch"


def lora_backend(device: torch.device) -> str:
    """How LoRA deltas are computed for tensors on `device` (on a CPU this may build the C++ ops, once)."""
    return _backend("LORAGATE_LORA_BACKEND", device)


def attention_backend(device: torch.device) -> str:
    """How decodes attend over the paged cache for tensors on `device`."""
    return _backend("LORAGATE_ATTENTION_BACKEND", device)
