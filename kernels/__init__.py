"""Batched-LoRA kernels: Triton ones (`sgmv.py`) and their pure-torch twins (`reference.py`), which are
both the CPU serving path and the test oracle.

`lora_backend(device)` is the seam: "triton" for CUDA tensors, "torch" for CPU ones. The environment
variable LORAGATE_LORA_BACKEND=torch|triton forces either (the tests run the Triton kernels on CPU tensors
under TRITON_INTERPRET=1 this way). Importing triton is left to the caller that needs it.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("torch", "triton")


def lora_backend(device: torch.device) -> str:
    forced = os.environ.get("LORAGATE_LORA_BACKEND", "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"LORAGATE_LORA_BACKEND must be one of {', '.join(BACKENDS)}, not {forced!r}")
        return forced
    return "triton" if torch.device(device).type == "cuda" else "torch"
