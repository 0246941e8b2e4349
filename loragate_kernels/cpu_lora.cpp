// The CPU path's batched LoRA for one module group (q/k/v, o, gate/up or down) of one layer: every segment of a
// step in one call, reading each adapter's A and B.T straight from the unified page pool through the slot tables
// (the same arguments and result as loragate_kernels/reference.py `lora_sgmv_group`, the oracle;
// loragate_kernels/cpu_ops.py builds this file and documents the op).
//
//   shrink:  h[rows, c_k : c_k + R_k] = x[rows] @ A_k.T            per segment, A_k [R_k, in] (the group's stack)
//   expand:  y[rows, out_cols[m] : out_cols[m + 1]] += h[rows, c_mk : c_mk + r_mk] @ B_mk.T
//            where the pool holds B_mk.T as [r_mk, out_m] row-major: an output row gains r_mk scaled rows of it
//
// Products and sums in fp32 whatever the weights' dtype (fp32, bf16 or fp16); y is read, added to and rounded
// once. Work is split over (segment, rank row) for the shrink and (segment, module, 64 output columns) for the
// expand, through ATen's intra-op thread pool (torch.set_num_threads applies). Each weight is read once per
// step (rows go four at a time through the shrink and the expand, so a prefill chunk reads each weight once per few
// rows): at serving sizes a memory-bound loop over the adapters' bytes, with no padding to a common rank and no copy
// of the weights, each work item prefetching the next one's.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_common.h"

namespace {

using loragate_cpu::store;
using loragate_cpu::to_f;

// Ask for `bytes` from p ahead of their use. An adapter's rows are short, strided (B.T's column blocks) and
// scattered over the pool, and the step's GEMMs have pushed them out of the caches since the last step: the
// hardware prefetchers follow them poorly. Each work item asks for the next one's weights (the shrink: the A row two
// rows ahead, within its dot loop; the expand: the next item's B.T block).
inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t l = 0; l < bytes; l += 64) __builtin_prefetch(static_cast<const char*>(p) + l, 0, 3);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
// bf16 x bf16 dot products on the CPU's bf16 units (vdpbf16ps: pairs multiplied exactly, summed in fp32): one A
// row against N rows of x, `stride` elements apart, into out[0], out[out_stride], ...; the A row two rows ahead is
// prefetched as this one is read.
template <int N>
inline void dot_bf16(const c10::BFloat16* a, const c10::BFloat16* x0, int64_t stride, int64_t d, float* out,
                     int64_t out_stride) {
  __m512 c[N];
  for (int i = 0; i < N; ++i) c[i] = _mm512_setzero_ps();
  int64_t e = 0;
  for (; e + 32 <= d; e += 32) {
    __builtin_prefetch(a + e + 2 * d, 0, 3);
    const __m512bh av = (__m512bh)_mm512_loadu_si512(a + e);
    for (int i = 0; i < N; ++i) c[i] = _mm512_dpbf16_ps(c[i], av, (__m512bh)_mm512_loadu_si512(x0 + i * stride + e));
  }
  if (e < d) {
    const __mmask32 k = (__mmask32)((1ull << (d - e)) - 1);
    const __m512bh av = (__m512bh)_mm512_maskz_loadu_epi16(k, a + e);
    for (int i = 0; i < N; ++i)
      c[i] = _mm512_dpbf16_ps(c[i], av, (__m512bh)_mm512_maskz_loadu_epi16(k, x0 + i * stride + e));
  }
  for (int i = 0; i < N; ++i) out[i * out_stride] = _mm512_reduce_add_ps(c[i]);
}
constexpr bool kBf16Dots = true;
#else
template <int N>
inline void dot_bf16(const c10::BFloat16*, const c10::BFloat16*, int64_t, int64_t, float*, int64_t) {}
constexpr bool kBf16Dots = false;
#endif

constexpr int64_t kCols = 64;  // output columns per expand work item

#if defined(__AVX512F__)
using loragate_cpu::load16;
using loragate_cpu::store16;

// The same dot products for any dtype, converted to fp32 as loaded (fp32 and fp16 weights; bf16 ones on CPUs
// without the bf16 dot instructions), with the same prefetch.
template <typename T, int N>
inline void dot_rows(const T* a, const T* x0, int64_t stride, int64_t d, float* out, int64_t out_stride) {
  __m512 c[N];
  for (int i = 0; i < N; ++i) c[i] = _mm512_setzero_ps();
  int64_t e = 0;
  for (; e + 16 <= d; e += 16) {
    __builtin_prefetch(a + e + 2 * d, 0, 3);
    const __m512 av = load16(a + e);
    for (int i = 0; i < N; ++i) c[i] = _mm512_fmadd_ps(av, load16(x0 + i * stride + e), c[i]);
  }
  for (int i = 0; i < N; ++i) {
    float sum = _mm512_reduce_add_ps(c[i]);
    for (int64_t t = e; t < d; ++t) sum += to_f(a[t]) * to_f(x0[i * stride + t]);
    out[i * out_stride] = sum;
  }
}

// y[R rows, 64 columns] += h[R rows, r] @ B.T[r, 64 columns] with the 4 x R sums in registers: each B.T row is
// converted once for the R rows, and each y row is read, added to and rounded once.
template <typename T, int R>
inline void expand_rows(const T* b_t, int64_t out, int64_t r, const float* h, int64_t h_width, T* y,
                        int64_t y_stride) {
  __m512 acc[R][4];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t q = 0; q < r; ++q) {
    const T* row = b_t + q * out;
    __m512 b[4];
    for (int c = 0; c < 4; ++c) b[c] = load16(row + 16 * c);
    for (int i = 0; i < R; ++i) {
      const __m512 hv = _mm512_set1_ps(h[i * h_width + q]);
      for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_fmadd_ps(b[c], hv, acc[i][c]);
    }
  }
  for (int i = 0; i < R; ++i) {
    T* yr = y + i * y_stride;
    for (int c = 0; c < 4; ++c) store16(yr + 16 * c, _mm512_add_ps(load16(yr + 16 * c), acc[i][c]));
  }
}
static_assert(kCols == 64, "expand_rows holds 64 columns in four registers");
#endif

struct ExpandItem {
  int64_t seg, module, col0;
};

template <typename T>
void group_impl(at::Tensor& y, const at::Tensor& x, const at::Tensor& pool, const int64_t* starts,
                const int64_t* slots, int64_t num_segs, const int64_t* a_off, const int64_t* ranks,
                const int64_t* b_off, const int64_t* h_cols, const int64_t* rank_total, int64_t num_slots,
                const std::vector<int64_t>& out_cols) {
  const int64_t d = x.size(1), num_modules = static_cast<int64_t>(out_cols.size()) - 1;
  const int64_t x_stride = x.stride(0), y_stride = y.stride(0), pool_size = pool.numel();
  const T* xp = x.data_ptr<T>();
  const T* pp = pool.data_ptr<T>();
  T* yp = y.data_ptr<T>();

  // The work lists and h, kept by the calling thread from call to call: a step makes 120 calls (SmolLM2), each
  // with the same few hundred items, and an allocation each costs more than a decode step's shrink of a group.
  // (Named through references: the worker threads must see the caller's, not their own thread_local copies.)
  thread_local std::vector<std::pair<int64_t, int64_t>> shrink_items;  // (segment, rank row)
  thread_local std::vector<ExpandItem> expand_items;
  thread_local std::vector<float> h_rows;
  auto& shrink = shrink_items;
  auto& expand = expand_items;
  auto& h = h_rows;
  shrink.clear();
  expand.clear();
  int64_t h_width = 0;
  for (int64_t s = 0; s < num_segs; ++s) {
    const int64_t k = slots[s], rows = starts[s + 1] - starts[s];
    TORCH_CHECK(k >= 0 && k < num_slots, "segment ", s, " names slot ", k, " of ", num_slots);
    const int64_t big_r = rank_total[k];
    if (rows == 0 || big_r == 0) continue;
    TORCH_CHECK(a_off[k] >= 0 && a_off[k] + big_r * d <= pool_size, "slot ", k, "'s A overruns the pool");
    h_width = std::max(h_width, big_r);
    for (int64_t j = 0; j < big_r; ++j) shrink.emplace_back(s, j);
    for (int64_t m = 0; m < num_modules; ++m) {
      const int64_t r = ranks[m * num_slots + k], out = out_cols[m + 1] - out_cols[m];
      if (r == 0) continue;
      TORCH_CHECK(h_cols[m * num_slots + k] >= 0 && h_cols[m * num_slots + k] + r <= big_r,
                  "slot ", k, "'s rank columns exceed its group rank");
      TORCH_CHECK(b_off[m * num_slots + k] >= 0 && b_off[m * num_slots + k] + r * out <= pool_size,
                  "slot ", k, "'s B overruns the pool");
      for (int64_t c = 0; c < out; c += kCols) expand.push_back({s, m, c});
    }
  }
  if (shrink.empty()) return;
  const int64_t row0 = starts[0];
  h.resize(static_cast<size_t>(starts[num_segs] - row0) * h_width);  // every entry the expand reads is written first

  at::parallel_for(0, static_cast<int64_t>(shrink.size()), 8, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const auto [s, j] = shrink[i];
      const T* a = pp + a_off[slots[s]] + j * d;
      int64_t t = starts[s];
      float* ht = h.data() + (t - row0) * h_width + j;  // h[t, j]
      if constexpr (std::is_same_v<T, c10::BFloat16> && kBf16Dots) {
        for (; t + 4 <= starts[s + 1]; t += 4, ht += 4 * h_width)
          dot_bf16<4>(a, xp + t * x_stride, x_stride, d, ht, h_width);
        for (; t < starts[s + 1]; ++t, ht += h_width) dot_bf16<1>(a, xp + t * x_stride, x_stride, d, ht, h_width);
      }
#if defined(__AVX512F__)
      for (; t + 4 <= starts[s + 1]; t += 4, ht += 4 * h_width)
        dot_rows<T, 4>(a, xp + t * x_stride, x_stride, d, ht, h_width);
      for (; t < starts[s + 1]; ++t, ht += h_width) dot_rows<T, 1>(a, xp + t * x_stride, x_stride, d, ht, h_width);
#endif
      for (; t + 4 <= starts[s + 1]; t += 4) {  // without AVX-512: four rows per read of the A row
        const T *x0 = xp + t * x_stride, *x1 = x0 + x_stride, *x2 = x1 + x_stride, *x3 = x2 + x_stride;
        float c0 = 0.f, c1 = 0.f, c2 = 0.f, c3 = 0.f;
#pragma omp simd reduction(+ : c0, c1, c2, c3)
        for (int64_t e = 0; e < d; ++e) {
          const float ae = to_f(a[e]);
          c0 += ae * to_f(x0[e]);
          c1 += ae * to_f(x1[e]);
          c2 += ae * to_f(x2[e]);
          c3 += ae * to_f(x3[e]);
        }
        float* hp = h.data() + (t - row0) * h_width + j;
        hp[0] = c0;
        hp[h_width] = c1;
        hp[2 * h_width] = c2;
        hp[3 * h_width] = c3;
      }
      for (; t < starts[s + 1]; ++t) {
        const T* xr = xp + t * x_stride;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t e = 0; e < d; ++e) acc += to_f(a[e]) * to_f(xr[e]);
        h[(t - row0) * h_width + j] = acc;
      }
    }
  });

  at::parallel_for(0, static_cast<int64_t>(expand.size()), 4, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const ExpandItem item = expand[i];
      const int64_t k = slots[item.seg], m = item.module;
      const int64_t r = ranks[m * num_slots + k], out = out_cols[m + 1] - out_cols[m];
      const int64_t width = std::min(kCols, out - item.col0), h_col = h_cols[m * num_slots + k];
      const T* b_t = pp + b_off[m * num_slots + k] + item.col0;  // column col0 of B.T [r, out]
      if (i + 1 < hi) {  // the next item's block of B.T
        const ExpandItem next = expand[i + 1];
        const int64_t nk = slots[next.seg], nm = next.module, n_out = out_cols[nm + 1] - out_cols[nm];
        const T* nb = pp + b_off[nm * num_slots + nk] + next.col0;
        const int64_t bytes = std::min(kCols, n_out - next.col0) * static_cast<int64_t>(sizeof(T));
        for (int64_t q = 0; q < ranks[nm * num_slots + nk]; ++q) prefetch(nb + q * n_out, bytes);
      }
      int64_t t = starts[item.seg];
#if defined(__AVX512F__)
      if (width == kCols) {
        const float* ht = h.data() + (t - row0) * h_width + h_col;
        T* yt = yp + t * y_stride + out_cols[m] + item.col0;
        for (; t + 4 <= starts[item.seg + 1]; t += 4, ht += 4 * h_width, yt += 4 * y_stride)
          expand_rows<T, 4>(b_t, out, r, ht, h_width, yt, y_stride);
        for (; t < starts[item.seg + 1]; ++t, ht += h_width, yt += y_stride)
          expand_rows<T, 1>(b_t, out, r, ht, h_width, yt, y_stride);
      }
#endif
      if (width == kCols) {
        for (; t + 2 <= starts[item.seg + 1]; t += 2) {  // two rows per read of each B row
          float acc0[kCols] = {0.f}, acc1[kCols] = {0.f};
          const float* h0 = h.data() + (t - row0) * h_width + h_col;
          const float* h1 = h0 + h_width;
          for (int64_t q = 0; q < r; ++q) {
            const float hq0 = h0[q], hq1 = h1[q];
            const T* row = b_t + q * out;
#pragma omp simd
            for (int64_t c = 0; c < kCols; ++c) {
              const float bc = to_f(row[c]);
              acc0[c] += bc * hq0;
              acc1[c] += bc * hq1;
            }
          }
          T* y0 = yp + t * y_stride + out_cols[m] + item.col0;
          T* y1 = y0 + y_stride;
#pragma omp simd
          for (int64_t c = 0; c < kCols; ++c) {
            store(y0 + c, to_f(y0[c]) + acc0[c]);
            store(y1 + c, to_f(y1[c]) + acc1[c]);
          }
        }
      }
      for (; t < starts[item.seg + 1]; ++t) {
        float acc[kCols] = {0.f};
        const float* ht = h.data() + (t - row0) * h_width + h_col;
        T* yr = yp + t * y_stride + out_cols[m] + item.col0;
        if (width == kCols) {
          for (int64_t q = 0; q < r; ++q) {
            const float hq = ht[q];
            const T* row = b_t + q * out;
#pragma omp simd
            for (int64_t c = 0; c < kCols; ++c) acc[c] += to_f(row[c]) * hq;
          }
#pragma omp simd
          for (int64_t c = 0; c < kCols; ++c) store(yr + c, to_f(yr[c]) + acc[c]);
        } else {
          for (int64_t q = 0; q < r; ++q) {
            const float hq = ht[q];
            const T* row = b_t + q * out;
            for (int64_t c = 0; c < width; ++c) acc[c] += to_f(row[c]) * hq;
          }
          for (int64_t c = 0; c < width; ++c) store(yr + c, to_f(yr[c]) + acc[c]);
        }
      }
    }
  });
}

const int64_t* ints(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.device().is_cpu(), name,
              " must be a contiguous int64 CPU tensor");
  return t.data_ptr<int64_t>();
}

void lora_sgmv_group(at::Tensor y, const at::Tensor& x, const at::Tensor& seg_starts, const at::Tensor& seg_slots,
                     const at::Tensor& pool, const at::Tensor& a_offsets, const at::Tensor& ranks,
                     const at::Tensor& b_offsets, const at::Tensor& h_cols, const at::Tensor& rank_total,
                     at::IntArrayRef out_cols) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.size(0) == x.size(0), "y and x must be [T, *] with equal T");
  TORCH_CHECK(y.device().is_cpu() && x.device().is_cpu() && pool.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(y.scalar_type() == x.scalar_type() && x.scalar_type() == pool.scalar_type(),
              "y, x and pool must share a dtype");
  TORCH_CHECK(y.stride(1) == 1 && x.stride(1) == 1, "y and x need contiguous columns");
  TORCH_CHECK(pool.dim() == 1 && pool.is_contiguous(), "pool must be a contiguous 1-D tensor");
  TORCH_CHECK(out_cols.size() >= 2 && out_cols.front() == 0 && out_cols.back() == y.size(1),
              "out_cols must run from 0 to y's width");
  const int64_t num_segs = seg_slots.numel(), num_slots = a_offsets.numel(), num_modules = out_cols.size() - 1;
  TORCH_CHECK(seg_starts.numel() == num_segs + 1, "seg_starts must have one more entry than seg_slots");
  TORCH_CHECK(ranks.numel() == num_modules * num_slots && b_offsets.numel() == num_modules * num_slots &&
                  h_cols.numel() == num_modules * num_slots && rank_total.numel() == num_slots,
              "tables must be [modules, slots] (ranks, b_offsets, h_cols) and [slots] (a_offsets, rank_total)");
  const int64_t* starts = ints(seg_starts, "seg_starts");
  for (int64_t s = 0; s < num_segs; ++s)
    TORCH_CHECK(starts[s] >= 0 && starts[s] <= starts[s + 1] && starts[s + 1] <= x.size(0),
                "seg_starts must be nondecreasing within [0, ", x.size(0), "]");
  for (size_t m = 0; m + 1 < out_cols.size(); ++m) TORCH_CHECK(out_cols[m] <= out_cols[m + 1], "out_cols must rise");
  if (num_segs == 0) return;
  const std::vector<int64_t> cols(out_cols.begin(), out_cols.end());
  const int64_t* slots = ints(seg_slots, "seg_slots");
  const int64_t *a = ints(a_offsets, "a_offsets"), *r = ints(ranks, "ranks"), *b = ints(b_offsets, "b_offsets");
  const int64_t *hc = ints(h_cols, "h_cols"), *rt = ints(rank_total, "rank_total");
  switch (y.scalar_type()) {
    case at::kFloat:
      return group_impl<float>(y, x, pool, starts, slots, num_segs, a, r, b, hc, rt, num_slots, cols);
    case at::kBFloat16:
      return group_impl<c10::BFloat16>(y, x, pool, starts, slots, num_segs, a, r, b, hc, rt, num_slots, cols);
    case at::kHalf:
      return group_impl<c10::Half>(y, x, pool, starts, slots, num_segs, a, r, b, hc, rt, num_slots, cols);
    default:
      TORCH_CHECK(false, "float32, bfloat16 or float16 only, not ", y.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(loragate_cpu, m) {
  m.def(
      "lora_sgmv_group(Tensor(a!) y, Tensor x, Tensor seg_starts, Tensor seg_slots, Tensor pool, Tensor a_offsets, "
      "Tensor ranks, Tensor b_offsets, Tensor h_cols, Tensor rank_total, int[] out_cols) -> ()");
}

TORCH_LIBRARY_IMPL(loragate_cpu, CPU, m) { m.impl("lora_sgmv_group", &lora_sgmv_group); }
