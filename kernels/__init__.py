"""Batched-LoRA kernels (Triton) and their pure-torch twins."""
