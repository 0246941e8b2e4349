"""The CUDA path's Triton kernels (also run on CPU tensors under Triton's interpreter, for the tests): batched LoRA
(`sgmv.py`) and paged decode attention (`paged_attention.py`); `jit.py` keeps each kernel in both forms."""
