"""Kernels: batched LoRA (Triton `sgmv.py` and its pure-torch twins in `reference.py`, which are both the CPU
serving path and the test oracle) and paged decode attention (Triton `paged_attention.py`; the torch path is in
engine/model/attention.py).

`lora_backend(device)` and `attention_backend(device)` are the seams: "triton" for CUDA tensors, "torch" for
CPU ones. The environment variables LORAGATE_LORA_BACKEND and LORAGATE_ATTENTION_BACKEND (torch|triton) force
either: the tests run the Triton kernels on CPU tensors this way, under Triton's interpreter
(kernels/triton_jit.py). Importing triton is left to the caller that needs it.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("torch", "triton")


def _backend(variable: str, device: torch.device) -> str:
    forced = os.environ.get(variable, "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"{variable} must be one of {', '.join(BACKENDS)}, not {forced!r}")
        return forced
    return "triton" if torch.device(device).type == "cuda" else "torch"


def lora_backend(device: torch.device) -> str:
    """How LoRA deltas are computed for tensors on `device`."""
    return _backend("LORAGATE_LORA_BACKEND", device)


def attention_backend(device: torch.device) -> str:
    """How decodes attend over the paged cache for tensors on `device`."""
    return _backend("LORAGATE_ATTENTION_BACKEND", device)
