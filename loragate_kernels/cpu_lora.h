// The CPU LoRA op's plan of one call (loragate_kernels/cpu_lora.cpp builds and runs it), shared with the GEMMs that
// fuse the op into their own call (cpu_gemm.cpp `skinny_linear_lora`, cpu_amx.cpp `amx_linear_lora`).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace loragate_cpu {

// Rows [t0, t1) of segment `seg` against every module of its adapter in the group: the shrink over the stacked A,
// then an expand per module; nothing from any other unit.
struct LoraUnit {
  int64_t seg, t0, t1;
};

// One call's work: the checked arguments as pointers, the units, and their split into parts of about equal cost
// (part p runs units [bounds[p], bounds[p + 1]), in order; one part per thread).
struct LoraPlan {
  at::ScalarType dtype = at::kFloat;
  char* y = nullptr;
  const char* x = nullptr;
  const char* pool = nullptr;
  int64_t elem = 0, x_stride = 0, y_stride = 0, d = 0, num_slots = 0, max_rank_total = 0;
  const int64_t *starts = nullptr, *slots = nullptr, *a_off = nullptr, *ranks = nullptr, *b_off = nullptr,
                *h_cols = nullptr, *rank_total = nullptr;
  std::vector<int64_t> out_cols;
  std::vector<LoraUnit> units;
  std::vector<int64_t> bounds;

  int64_t parts() const { return bounds.empty() ? 0 : static_cast<int64_t>(bounds.size()) - 1; }
  int64_t num_modules() const { return static_cast<int64_t>(out_cols.size()) - 1; }
  // unit i's stacked A (which = 0) or module which - 1's B.T: where they start in the pool and their bytes (the
  // order the unit reads them, and the pool's: engine/lora/batch.py SlotTables)
  std::pair<const char*, int64_t> weights(int64_t i, int64_t which) const;
};

// Checks the op's arguments (TORCH_CHECK, before anything is written) and plans the call, one part per thread of
// at::get_num_threads(). The plan is the calling thread's own, reused from call to call (a step makes 120 calls with
// the same few hundred units, and an allocation each would cost more than a decode unit's work).
LoraPlan& plan_lora(const at::Tensor& y, const at::Tensor& x, const at::Tensor& segments, const at::Tensor& pool,
                    const at::Tensor& block, at::IntArrayRef out_cols);

// y += the planned deltas: every part on its own thread of ATen's pool, in one parallel region.
void run_lora(const LoraPlan& plan);

}  // namespace loragate_cpu
