// The CPU path's greedy pick (loragate_kernels/cpu/build.py builds this file, loragate_kernels/cpu/ops.py documents the
// op; engine/worker/sampler.py calls it, and its torch form, `argmax_list` after `finite_rows`, is the test oracle):
// one pass over each row of logits finds the first index of the row's maximum and whether every logit is finite. In
// torch that is a sum (for finiteness) and a max over the whole batch, and on bf16 logits torch's max is not
// vectorised: several times this pass's time for 32 rows of a 49,152-token vocabulary (docs/performance.md has the
// figures).
//
//   greedy_rows(logits [B, V], banned [n] int64, non_finite, no_token) -> [B] int64
//       the first index of each row's maximum over the columns not in `banned` (EOS while min_tokens is unmet);
//       `non_finite` where any logit of the row (banned ones included) is NaN or infinite; `no_token` where every
//       column is banned.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "common.h"

namespace {

using loragate_cpu::to_f;

struct Best {
  float value = -std::numeric_limits<float>::infinity();
  int64_t index = -1;
  bool finite = true;
};

// The first maximum of row[lo:hi) folded into `best` (an earlier range's maximum wins ties), and whether every
// value is finite. Columns are compared in fp32 (exact for bf16 and fp16).
template <typename T>
void scan(const T* row, int64_t lo, int64_t hi, Best& best) {
  int64_t e = lo;
#if defined(__AVX512F__)
  if (hi - lo >= 16) {
    using loragate_cpu::load16;
    const __m512 zero = _mm512_setzero_ps();
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512i top_at = _mm512_set1_epi32(-1), at = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(lo)),
                                                                   _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                                                                     10, 11, 12, 13, 14, 15));
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 bad = 0;
    for (; e + 16 <= hi; e += 16, at = _mm512_add_epi32(at, step)) {
      const __m512 v = load16(row + e);
      bad |= _mm512_cmp_ps_mask(_mm512_sub_ps(v, v), zero, _CMP_NEQ_UQ);  // v - v is NaN exactly for NaN and inf
      const __mmask16 gt = _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ);       // strictly: each lane keeps its first
      top = _mm512_mask_mov_ps(top, gt, v);
      top_at = _mm512_mask_mov_epi32(top_at, gt, at);
    }
    if (bad) best.finite = false;
    const float m = _mm512_reduce_max_ps(top);
    // lanes that saw a value above -inf; among those holding the maximum, the smallest index is the first
    const __mmask16 holds = _mm512_cmp_ps_mask(top, _mm512_set1_ps(m), _CMP_EQ_OQ) &
                            _mm512_cmp_epi32_mask(top_at, _mm512_setzero_si512(), _MM_CMPINT_NLT);
    if (holds && (best.index < 0 || m > best.value)) {
      best.value = m;
      best.index = _mm512_mask_reduce_min_epi32(holds, top_at);
    }
  }
#endif
  for (; e < hi; ++e) {
    const float v = to_f(row[e]);
    if (!std::isfinite(v)) best.finite = false;
    if (best.index < 0 || v > best.value) {
      best.value = v;
      best.index = e;
    }
  }
}

template <typename T>
void greedy_impl(const at::Tensor& logits, const std::vector<int64_t>& banned, int64_t non_finite, int64_t no_token,
                 int64_t* out) {
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  const T* base = logits.data_ptr<T>();
  at::parallel_for(0, rows, 8, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const T* row = base + i * stride;
      Best best;
      int64_t from = 0;
      for (const int64_t b : banned) {  // the ranges between banned columns, in order
        scan(row, from, b, best);
        if (!std::isfinite(to_f(row[b]))) best.finite = false;
        from = b + 1;
      }
      scan(row, from, vocab, best);
      out[i] = !best.finite ? non_finite : best.index < 0 ? no_token : best.index;
    }
  });
}

at::Tensor greedy_rows(const at::Tensor& logits, const at::Tensor& banned, int64_t non_finite, int64_t no_token) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.device().is_cpu(),
              "logits must be a 2-D CPU tensor with contiguous columns");
  TORCH_CHECK(logits.size(1) < std::numeric_limits<int32_t>::max(), "the vocabulary must fit in int32");
  TORCH_CHECK(banned.dim() == 1 && banned.scalar_type() == at::kLong && banned.device().is_cpu(),
              "banned must be a 1-D int64 CPU tensor");
  const at::Tensor ids = banned.contiguous();
  std::vector<int64_t> cols(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
  for (const int64_t c : cols)
    TORCH_CHECK(c >= 0 && c < logits.size(1), "banned column ", c, " is outside the vocabulary of ", logits.size(1));
  std::sort(cols.begin(), cols.end());
  cols.erase(std::unique(cols.begin(), cols.end()), cols.end());
  at::Tensor out = at::empty({logits.size(0)}, at::kLong);
  switch (logits.scalar_type()) {
    case at::kFloat:
      greedy_impl<float>(logits, cols, non_finite, no_token, out.data_ptr<int64_t>());
      break;
    case at::kBFloat16:
      greedy_impl<c10::BFloat16>(logits, cols, non_finite, no_token, out.data_ptr<int64_t>());
      break;
    case at::kHalf:
      greedy_impl<c10::Half>(logits, cols, non_finite, no_token, out.data_ptr<int64_t>());
      break;
    default:
      TORCH_CHECK(false, "float32, bfloat16 or float16 logits only, not ", logits.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate_cpu, m) {
  m.def("greedy_rows(Tensor logits, Tensor banned, int non_finite, int no_token) -> Tensor");
}

TORCH_LIBRARY_IMPL(loragate_cpu, CPU, m) { m.impl("greedy_rows", &greedy_rows); }
