"""Kernels, by target:

- `cpu/`: the CPU path's C++ ops (batched LoRA, paged attention, a decoder layer's fused elementwise ops, the greedy
  pick, the GEMMs), their builder (`cpu/build.py`) and their Python entry points (`cpu/ops.py`).
- `triton/`: the CUDA path's Triton kernels (batched LoRA as shrink and expand, paged decode attention), which the
  tests run on CPU tensors under Triton's interpreter.
- `reference.py`: the torch twins of the LoRA kernels, the test oracle and the CPU route where the C++ ops cannot be
  built. The twins of the other seams sit beside the seam they back: attention's in engine/model/attention.py, the
  layer ops' in engine/model/layer_ops.py, the greedy pick's in engine/worker/sampler.py, the GEMMs' is F.linear.
- `backends.py`: which of them runs each seam on a given device and dtype, decided once (`Backends.resolve`).

Importing triton is left to the caller that needs it.
"""
