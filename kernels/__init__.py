"""Kernels: batched LoRA (Triton `sgmv.py`, the C++ CPU op `cpu_lora.cpp`, and the pure-torch twins in
`reference.py`, which are the test oracle and the CPU path where the op cannot be built) and paged decode
attention (Triton `paged_attention.py`; the torch path is in engine/model/attention.py).

`lora_backend(device)` and `attention_backend(device)` are the seams: "triton" for CUDA tensors; for CPU ones
"cpp" for LoRA where kernels/cpu_lora.py could build its op (else "torch"), "torch" for attention. The
environment variables LORAGATE_LORA_BACKEND (torch|triton|cpp) and LORAGATE_ATTENTION_BACKEND (torch|triton)
force one: the tests run the Triton kernels on CPU tensors this way, under Triton's interpreter
(kernels/triton_jit.py), and the torch twins' path. Importing triton is left to the caller that needs it.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("torch", "triton")
LORA_BACKENDS = (*BACKENDS, "cpp")


def _backend(variable: str, device: torch.device, choices: tuple[str, ...] = BACKENDS) -> str | None:
    """The backend `variable` forces, "triton" on CUDA, or None (the caller's CPU default)."""
    forced = os.environ.get(variable, "").strip().lower()
    if forced:
        if forced not in choices:
            raise ValueError(f"{variable} must be one of {', '.join(choices)}, not {forced!r}")
        return forced
    return "triton" if torch.device(device).type == "cuda" else None


def lora_backend(device: torch.device) -> str:
    """How LoRA deltas are computed for tensors on `device` (on a CPU this may build the C++ op, once)."""
    from kernels import cpu_lora

    backend = _backend("LORAGATE_LORA_BACKEND", device, LORA_BACKENDS)
    if backend == "cpp" and not cpu_lora.load():
        raise ValueError(f"LORAGATE_LORA_BACKEND=cpp, but the CPU op cannot be built: {cpu_lora.unavailable_reason()}")
    if backend is None:
        backend = "cpp" if cpu_lora.load() else "torch"
    return backend


def attention_backend(device: torch.device) -> str:
    """How decodes attend over the paged cache for tensors on `device`."""
    return _backend("LORAGATE_ATTENTION_BACKEND", device) or "torch"
