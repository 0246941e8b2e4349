"""Kernels: batched LoRA (Triton `sgmv.py`, the CPU's C++ op `cpu_lora.cpp`, and the pure-torch twins in
`reference.py`, which are the test oracle and the CPU path where the C++ ops cannot be built) and paged decode
attention (Triton `paged_attention.py`, the CPU's C++ op `cpu_attention.cpp`; the torch path is in
engine/model/attention.py), and a decoder layer's fused elementwise ops on the CPU (`cpu_layer.cpp`; the torch
twins are in engine/model/layer_ops.py). `cpu_ops.py` builds the C++ ops.

`lora_backend(device)` and `attention_backend(device)` are the seams: "triton" for CUDA tensors; for CPU ones "cpp"
where kernels/cpu_ops.py could build its ops, else "torch". The environment variables LORAGATE_LORA_BACKEND and
LORAGATE_ATTENTION_BACKEND (torch|triton|cpp) force one: the tests run the Triton kernels on CPU tensors this way,
under Triton's interpreter (kernels/triton_jit.py), and the torch paths. `layer_backend(device)` is the seam of the
layer ops and the sampler's greedy pick ("cpp" or "torch"; CUDA runs torch's; LORAGATE_LAYER_BACKEND forces one).
Importing triton is left to the caller that needs it.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("torch", "triton", "cpp")


def _backend(variable: str, device: torch.device, gpu: str = "triton", choices: tuple[str, ...] = BACKENDS) -> str:
    """The backend `variable` forces; else `gpu` on CUDA, on a CPU "cpp" where the C++ ops build, else "torch"."""
    from kernels import cpu_ops

    forced = os.environ.get(variable, "").strip().lower()
    if forced:
        if forced not in choices:
            raise ValueError(f"{variable} must be one of {', '.join(choices)}, not {forced!r}")
        if forced == "cpp" and not cpu_ops.load():
            raise ValueError(f"{variable}=cpp, but the CPU ops cannot be built: {cpu_ops.unavailable_reason()}")
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
