// The CPU LoRA op (loragate_kernels/cpu/lora.cpp) as a function, for the GEMMs that fuse it into their own call.
#pragma once

#include <ATen/ATen.h>

namespace loragate_cpu {

// y += a LoRA group's deltas for every segment: the op `lora_sgmv_group` (its arguments, checks and result), for the
// GEMMs that run it on their own output in the same call (cpu/gemm.cpp `skinny_linear_lora`, cpu/amx.cpp
// `amx_linear_lora`).
void add_lora(at::Tensor& y, const at::Tensor& x, const at::Tensor& segments, const at::Tensor& pool,
              const at::Tensor& block, at::IntArrayRef out_cols);

}  // namespace loragate_cpu
