// The CPU path's batched LoRA for one module group (q/k/v, o, gate/up or down) of one layer: every segment of a
// step in one call, reading each adapter's A and B.T straight from the unified page pool through the slot tables
// (the same arguments and result as loragate_kernels/reference.py `lora_sgmv_group`, the oracle;
// loragate_kernels/cpu/build.py builds this file, loragate_kernels/cpu/ops.py documents the op). Also DoRA's rescale
// of a group's rows (`dora_scale_group`, at the end).
//
//   shrink:  h[rows, 0 : r_mk] = x[rows] @ A_mk.T        A_mk = rows h_cols[m] .. + r_mk of A_k [R_k, in]
//   expand:  y[rows, out_cols[m] : out_cols[m + 1]] += h[rows, 0 : r_mk] @ B_mk.T
//            where the pool holds B_mk.T as [r_mk, out_m] row-major: an output row gains r_mk scaled rows of it
//
// Products and sums in fp32 whatever the weights' dtype (fp32, bf16 or fp16); y is read, added to and rounded
// once. The work is a list of units, one per (segment, chunk of up to 32 rows): a unit's shrink (over its
// adapter's A stacked for the group's modules, rank_total rows) and its expands need nothing from any other unit
// (h lives in the unit), so the whole call is one parallel region with no barrier, each thread taking a run of
// consecutive units of about equal cost (the bytes of their weights, plus their multiply-adds). A unit reads its
// adapter's weights for the group in pool order (stacked A, then each module's B.T: one contiguous sweep); a thread
// asks for the next unit's weights a few lines at a time while it computes this one (`LoraStream`), so the memory
// works while the core does. A decode step streams each weight once, a prefill chunk re-reads a unit's weights from
// L1/L2 for each 4 rows. A step's first call on a thread pays for its work lists; later ones reuse them.
//
// With AVX-512 the shrink takes 4 rows of x against 4 rows of A at once (16 sums in registers, folded into one
// register at the end by `transpose_sum16`; bf16 on the CPU's bf16 dot instruction where it has one) and the
// expand 4 rows of y by 64 columns (`expand_rows`); elsewhere plain loops the compiler vectorizes.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.h"
#include "lora.h"

namespace {

using loragate_cpu::store;
using loragate_cpu::to_f;

constexpr int64_t kRowChunk = 32;  // rows per unit: a prefill segment becomes several units
constexpr int64_t kCols = 64;      // output columns the expand holds in registers
constexpr int kDrip = 4;           // lines of the next unit's weights asked for per inner-loop step

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
  std::pair<const char*, int64_t> weights(int64_t i, int64_t which) const {
    const int64_t k = slots[units[i].seg];
    if (which == 0) return {pool + a_off[k] * elem, rank_total[k] * d * elem};
    const int64_t m = which - 1, r = ranks[m * num_slots + k];
    return {pool + b_off[m * num_slots + k] * elem, r * (out_cols[m + 1] - out_cols[m]) * elem};
  }
};

// A cursor over part p's weights in the order its units read them (each unit's stacked A, then its modules' B.T),
// asking for them into L2 a line at a time. Before unit i runs, `start(i)` asks for whatever of it is not yet asked
// for; while it runs, its kernels' inner loops call `drip()`, which asks for kDrip lines of unit i + 1. So memory
// fetches the next unit while the core computes this one: asked for all at once, the lines queue behind one another
// and the core waits for them; asked for a few per step, they arrive while it works.
struct LoraStream {
  const LoraPlan& plan;
  int64_t unit, end, which = -1;  // the region the cursor is in: unit's weights `which` (plan.weights)
  const char* cur = nullptr;      // the next line to ask for, `left` bytes before its region's end
  int64_t left = 0;
  int64_t last = -1;  // the last unit `drip` asks for: the one after the unit running

  LoraStream(const LoraPlan& plan, int64_t p) : plan(plan), unit(plan.bounds[p]), end(plan.bounds[p + 1]) {
    next_region();
  }

  void next_region() {
    while (unit < end) {
      if (++which > plan.num_modules()) {
        which = 0;
        if (++unit == end) break;
      }
      const auto [p, n] = plan.weights(unit, which);
      if (n > 0) {
        cur = p;
        left = n;
        return;
      }
    }
    cur = nullptr;
    left = 0;
  }
  void line() {
    if (left <= 0) return;
    __builtin_prefetch(cur, 0, 2);  // prefetcht1: into L2
    cur += 64;
    left -= 64;
    if (left <= 0) next_region();
  }
  void start(int64_t i) {
    while (unit <= i && left > 0) line();
    last = i + 1;
  }
  void drip() {
    if (unit <= last)
      for (int k = 0; k < kDrip; ++k) line();
  }
};

// h[t, j] = x[t] . a[j] for t < rows, j < r (h's rows `hs` apart), and y[t] += h[t] @ b_t: the loops the compiler
// vectorizes, for CPUs without AVX-512 and for what the AVX-512 blocks leave (columns past the last 64).
template <typename T>
void shrink_plain(const T* a, int64_t r, int64_t d, const T* x, int64_t xs, int64_t rows, float* h, int64_t hs,
                  LoraStream& ahead) {
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t j = 0; j < r; ++j) {
      ahead.drip();
      const T *xr = x + t * xs, *aj = a + j * d;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t e = 0; e < d; ++e) acc += to_f(aj[e]) * to_f(xr[e]);
      h[t * hs + j] = acc;
    }
}

template <typename T>
void expand_plain(const T* b_t, int64_t r, int64_t out, int64_t c0, const float* h, int64_t hs, int64_t rows, T* y,
                  int64_t ys, LoraStream& ahead) {
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t c = c0; c < out; c += kCols) {
      const int64_t width = std::min(kCols, out - c);
      float acc[kCols] = {0.f};
      for (int64_t q = 0; q < r; ++q) {
        ahead.drip();
        const float hq = h[t * hs + q];
        const T* row = b_t + q * out + c;
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) acc[i] += to_f(row[i]) * hq;
      }
      T* yr = y + t * ys + c;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) store(yr + i, to_f(yr[i]) + acc[i]);
    }
}

#if defined(__AVX512F__)
using loragate_cpu::load16;
using loragate_cpu::store16;
using loragate_cpu::transpose_sum16;

// Whether T's shrink runs on the bf16 dot instruction (vdpbf16ps: pairs multiplied exactly, summed in fp32).
template <typename T>
constexpr bool kBf16Dots =
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    std::is_same_v<T, c10::BFloat16>;
#else
    false;
#endif

// 16 elements from e of a row of n (lanes past n read as 0, nothing past n read).
template <typename T>
inline __m512 load16_upto(const T* p, int64_t e, int64_t n) {
  if (e + 16 <= n) return load16(p + e);
  T tail[16] = {};
  std::memcpy(tail, p + e, sizeof(T) * (n - e));
  return load16(tail);
}

// h[t, jj] = x[t] . a[jj] for t < TT rows of x (`xs` apart) and jj < jn <= 4 rows of A (`d` apart): 4 x TT sums
// in registers, one load of each x and A element per block, folded into one register by transpose_sum16 (lane
// 4 t + jj). Rows of A past jn repeat the last (never read past the adapter's rows); their sums are dropped.
template <typename T, int TT>
inline void shrink_block(const T* a, int64_t jn, int64_t d, const T* x, int64_t xs, float* h, int64_t hs,
                         LoraStream& ahead) {
  const T* ar[4];
  for (int jj = 0; jj < 4; ++jj) ar[jj] = a + std::min<int64_t>(jj, jn - 1) * d;
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  int64_t e = 0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (kBf16Dots<T>) {
    for (; e + 32 <= d; e += 32) {
      ahead.drip();
      __m512bh av[4];
      for (int jj = 0; jj < 4; ++jj) av[jj] = (__m512bh)_mm512_loadu_si512(ar[jj] + e);
      for (int t = 0; t < TT; ++t) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + t * xs + e);
        for (int jj = 0; jj < 4; ++jj) acc[4 * t + jj] = _mm512_dpbf16_ps(acc[4 * t + jj], av[jj], xv);
      }
    }
  }
#endif
  for (; e < d; e += 16) {
    ahead.drip();
    __m512 av[4];
    for (int jj = 0; jj < 4; ++jj) av[jj] = load16_upto(ar[jj], e, d);
    for (int t = 0; t < TT; ++t) {
      const __m512 xv = load16_upto(x + t * xs, e, d);
      for (int jj = 0; jj < 4; ++jj) acc[4 * t + jj] = _mm512_fmadd_ps(av[jj], xv, acc[4 * t + jj]);
    }
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, transpose_sum16(acc));
  for (int t = 0; t < TT; ++t)
    for (int64_t jj = 0; jj < jn; ++jj) h[t * hs + jj] = sums[4 * t + jj];
}

template <typename T, int TT>
inline void shrink_rows(const T* a, int64_t r, int64_t d, const T* x, int64_t xs, float* h, int64_t hs,
                        LoraStream& ahead) {
  for (int64_t j = 0; j < r; j += 4)
    shrink_block<T, TT>(a + j * d, std::min<int64_t>(4, r - j), d, x, xs, h + j, hs, ahead);
}

// y[R rows, 64 columns] += h[R rows, r] @ B.T[r, 64 columns] with the 4 x R sums in registers: each B.T row is
// converted once for the R rows, and each y row is read, added to and rounded once.
template <typename T, int R>
inline void expand_rows(const T* b_t, int64_t out, int64_t r, const float* h, int64_t hs, T* y, int64_t ys,
                        LoraStream& ahead) {
  __m512 acc[R][4];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t q = 0; q < r; ++q) {
    ahead.drip();
    const T* row = b_t + q * out;
    __m512 b[4];
    for (int c = 0; c < 4; ++c) b[c] = load16(row + 16 * c);
    for (int i = 0; i < R; ++i) {
      const __m512 hv = _mm512_set1_ps(h[i * hs + q]);
      for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_fmadd_ps(b[c], hv, acc[i][c]);
    }
  }
  for (int i = 0; i < R; ++i) {
    T* yr = y + i * ys;
    for (int c = 0; c < 4; ++c) store16(yr + 16 * c, _mm512_add_ps(load16(yr + 16 * c), acc[i][c]));
  }
}
static_assert(kCols == 64, "expand_rows holds 64 columns in four registers");

// Up to 4 rows at a time through the register blocks above.
template <typename F1, typename F2, typename F3, typename F4>
inline void by_fours(int64_t rows, F1 f1, F2 f2, F3 f3, F4 f4) {
  int64_t t = 0;
  for (; t + 4 <= rows; t += 4) f4(t);
  switch (rows - t) {
    case 3: f3(t); break;
    case 2: f2(t); break;
    case 1: f1(t); break;
    default: break;
  }
}
#endif

// One unit: rows [t0, t1) of a segment against its adapter's modules in the group. h: the thread's scratch
// (rows x the adapter's rank over the group).
template <typename T>
void run_unit(const LoraPlan& plan, int64_t i, float* h, LoraStream& ahead) {
  const LoraUnit u = plan.units[i];
  const int64_t k = plan.slots[u.seg], ns = plan.num_slots, hs = plan.rank_total[k], rows = u.t1 - u.t0, d = plan.d;
  const T* a = reinterpret_cast<const T*>(plan.weights(i, 0).first);
  const T* x = reinterpret_cast<const T*>(plan.x) + u.t0 * plan.x_stride;
  const int64_t xs = plan.x_stride, ys = plan.y_stride;
#if defined(__AVX512F__)
  by_fours(
      rows, [&](int64_t t) { shrink_rows<T, 1>(a, hs, d, x + t * xs, xs, h + t * hs, hs, ahead); },
      [&](int64_t t) { shrink_rows<T, 2>(a, hs, d, x + t * xs, xs, h + t * hs, hs, ahead); },
      [&](int64_t t) { shrink_rows<T, 3>(a, hs, d, x + t * xs, xs, h + t * hs, hs, ahead); },
      [&](int64_t t) { shrink_rows<T, 4>(a, hs, d, x + t * xs, xs, h + t * hs, hs, ahead); });
#else
  shrink_plain(a, hs, d, x, xs, rows, h, hs, ahead);
#endif
  for (int64_t m = 0; m < plan.num_modules(); ++m) {
    const int64_t r = plan.ranks[m * ns + k], out = plan.out_cols[m + 1] - plan.out_cols[m];
    if (r == 0) continue;
    const T* b_t = reinterpret_cast<const T*>(plan.weights(i, 1 + m).first);
    const float* hm = h + plan.h_cols[m * ns + k];
    T* y = reinterpret_cast<T*>(plan.y) + u.t0 * ys + plan.out_cols[m];
#if defined(__AVX512F__)
    const int64_t full = out / kCols * kCols;
    for (int64_t c = 0; c < full; c += kCols)
      by_fours(
          rows, [&](int64_t t) { expand_rows<T, 1>(b_t + c, out, r, hm + t * hs, hs, y + t * ys + c, ys, ahead); },
          [&](int64_t t) { expand_rows<T, 2>(b_t + c, out, r, hm + t * hs, hs, y + t * ys + c, ys, ahead); },
          [&](int64_t t) { expand_rows<T, 3>(b_t + c, out, r, hm + t * hs, hs, y + t * ys + c, ys, ahead); },
          [&](int64_t t) { expand_rows<T, 4>(b_t + c, out, r, hm + t * hs, hs, y + t * ys + c, ys, ahead); });
    if (full < out) expand_plain(b_t, r, out, full, hm, hs, rows, y, ys, ahead);
#else
    expand_plain(b_t, r, out, 0, hm, hs, rows, y, ys, ahead);
#endif
  }
}

template <typename T>
void run_part(const LoraPlan& plan, int64_t p) {
  thread_local std::vector<float> scratch;  // this thread's h: up to 32 rows x the largest rank over the group
  scratch.resize(static_cast<size_t>(kRowChunk * plan.max_rank_total));
  LoraStream stream(plan, p);
  for (int64_t i = plan.bounds[p]; i < plan.bounds[p + 1]; ++i) {
    stream.start(i);
    run_unit<T>(plan, i, scratch.data(), stream);
  }
}

const int64_t* ints(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.device().is_cpu(), name,
              " must be a contiguous int64 CPU tensor");
  return t.data_ptr<int64_t>();
}


// segments: [2 S + 1] int64, the S + 1 segment starts then the S slots. block: [2 + 3 M, slots] int64, one
// (layer, group)'s rows of the device tier's table (engine/lora/device_tier.py DeviceMirror): a_offsets, ranks[M],
// b_offsets[M], h_cols[M], rank_total, with M >= the modules out_cols names (groups of fewer use the first rows).
// Two tensors where there were seven: a decode step makes 120 calls, and each argument costs the dispatcher time.
// Checks every argument (TORCH_CHECK, before anything is written) and plans the call, one part per thread of
// at::get_num_threads(). The plan is the calling thread's own, reused from call to call (a step makes 120 calls with
// the same few hundred units, and an allocation each would cost more than a decode unit's work).
LoraPlan& plan_lora(const at::Tensor& y, const at::Tensor& x, const at::Tensor& segments, const at::Tensor& pool,
                    const at::Tensor& block, at::IntArrayRef out_cols) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.size(0) == x.size(0), "y and x must be [T, *] with equal T");
  TORCH_CHECK(y.device().is_cpu() && x.device().is_cpu() && pool.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(y.scalar_type() == x.scalar_type() && x.scalar_type() == pool.scalar_type(),
              "y, x and pool must share a dtype");
  TORCH_CHECK(y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16 || y.scalar_type() == at::kHalf,
              "float32, bfloat16 or float16 only, not ", y.scalar_type());
  TORCH_CHECK(y.stride(1) == 1 && x.stride(1) == 1, "y and x need contiguous columns");
  TORCH_CHECK(pool.dim() == 1 && pool.is_contiguous(), "pool must be a contiguous 1-D tensor");
  TORCH_CHECK(out_cols.size() >= 2 && out_cols.front() == 0 && out_cols.back() == y.size(1),
              "out_cols must run from 0 to y's width");
  TORCH_CHECK(segments.dim() == 1 && segments.numel() % 2 == 1, "segments must be [2 S + 1]: S + 1 starts, S slots");
  const int64_t num_segs = segments.numel() / 2, num_modules = static_cast<int64_t>(out_cols.size()) - 1;
  TORCH_CHECK(block.dim() == 2 && (block.size(0) - 2) % 3 == 0 && (block.size(0) - 2) / 3 >= num_modules,
              "block must be [2 + 3 M, slots] with M >= ", num_modules, " modules");
  const int64_t num_slots = block.size(1), rows_m = (block.size(0) - 2) / 3;
  const int64_t* starts = ints(segments, "segments");
  const int64_t* slots = starts + num_segs + 1;
  for (int64_t s = 0; s < num_segs; ++s)
    TORCH_CHECK(starts[s] >= 0 && starts[s] <= starts[s + 1] && starts[s + 1] <= x.size(0),
                "segment starts must be nondecreasing within [0, ", x.size(0), "]");
  for (size_t m = 0; m + 1 < out_cols.size(); ++m) TORCH_CHECK(out_cols[m] <= out_cols[m + 1], "out_cols must rise");
  const int64_t* a_off = ints(block, "block");
  const int64_t *ranks = a_off + num_slots, *b_off = ranks + rows_m * num_slots, *h_cols = b_off + rows_m * num_slots;
  const int64_t* rank_total = h_cols + rows_m * num_slots;

  thread_local LoraPlan plan_of_thread;
  LoraPlan& plan = plan_of_thread;  // (returned by reference: the workers must see the caller's plan, not their own)
  plan.dtype = y.scalar_type();
  plan.elem = static_cast<int64_t>(y.element_size());
  plan.y = static_cast<char*>(y.data_ptr());
  plan.x = static_cast<const char*>(x.data_ptr());
  plan.pool = static_cast<const char*>(pool.data_ptr());
  plan.x_stride = x.stride(0);
  plan.y_stride = y.stride(0);
  plan.d = x.size(1);
  plan.num_slots = num_slots;
  plan.starts = starts;
  plan.slots = slots;
  plan.a_off = a_off;
  plan.ranks = ranks;
  plan.b_off = b_off;
  plan.h_cols = h_cols;
  plan.out_cols.assign(out_cols.begin(), out_cols.end());
  plan.rank_total = rank_total;
  plan.units.clear();
  plan.bounds.clear();
  plan.max_rank_total = 0;

  // the units, and their running cost: a unit's weights cost their bytes once (from memory) plus a read from
  // cache per 4 rows' multiply-adds
  thread_local std::vector<int64_t> cost_of_thread;
  std::vector<int64_t>& cost = cost_of_thread;
  cost.clear();
  const int64_t d = plan.d, pool_size = pool.numel();
  int64_t total = 0;
  for (int64_t s = 0; s < num_segs; ++s) {
    const int64_t k = slots[s], rows = starts[s + 1] - starts[s];
    TORCH_CHECK(k >= 0 && k < num_slots, "segment ", s, " names slot ", k, " of ", num_slots);
    const int64_t big_r = rank_total[k];
    if (rows == 0 || big_r == 0) continue;
    TORCH_CHECK(big_r > 0 && a_off[k] >= 0 && a_off[k] + big_r * d <= pool_size, "slot ", k, "'s A overruns the pool");
    int64_t weights = big_r * d;
    for (int64_t m = 0; m < num_modules; ++m) {
      const int64_t r = ranks[m * num_slots + k], out = out_cols[m + 1] - out_cols[m];
      if (r == 0) continue;
      TORCH_CHECK(r > 0 && h_cols[m * num_slots + k] >= 0 && h_cols[m * num_slots + k] + r <= big_r,
                  "slot ", k, "'s rank columns exceed its group rank");
      TORCH_CHECK(b_off[m * num_slots + k] >= 0 && b_off[m * num_slots + k] + r * out <= pool_size,
                  "slot ", k, "'s B overruns the pool");
      weights += r * out;
    }
    plan.max_rank_total = std::max(plan.max_rank_total, big_r);
    for (int64_t t0 = starts[s]; t0 < starts[s + 1]; t0 += kRowChunk) {
      const int64_t t1 = std::min(starts[s + 1], t0 + kRowChunk);
      total += weights * (8 + (t1 - t0));
      plan.units.push_back({s, t0, t1});
      cost.push_back(total);
    }
  }
  if (plan.units.empty()) return plan;
  // part p: the units whose cost midpoint falls in [p, p + 1) * total / parts (consecutive, about equal)
  const int64_t n = static_cast<int64_t>(plan.units.size());
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  plan.bounds.assign(1, 0);
  int64_t i = 0;
  for (int64_t p = 1; p < parts; ++p) {
    while (i < n && (cost[i] + (i ? cost[i - 1] : 0)) * parts < 2 * p * total) ++i;  // 2 x midpoint
    plan.bounds.push_back(i);
  }
  plan.bounds.push_back(n);
  return plan;
}

// y += the planned deltas: every part on its own thread of ATen's pool, in one parallel region.
void run_lora(const LoraPlan& plan) {
  at::parallel_for(0, plan.parts(), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p) {
      switch (plan.dtype) {
        case at::kFloat: run_part<float>(plan, p); break;
        case at::kBFloat16: run_part<c10::BFloat16>(plan, p); break;
        default: run_part<c10::Half>(plan, p); break;  // plan_lora admits these three only
      }
    }
  });
}

// The op: y += the group's deltas.
void lora_sgmv_group(at::Tensor y, const at::Tensor& x, const at::Tensor& segments, const at::Tensor& pool,
                     const at::Tensor& block, at::IntArrayRef out_cols) {
  run_lora(plan_lora(y, x, segments, pool, block, out_cols));
}

// ---- DoRA's rescale of a group's rows (engine/lora/dora.py) --------------------------------------------------------
//
// y[rows] = g * y[rows] + (1 - g) * bias for every segment whose slot has row scales in this layer and group: g at
// g_offsets[k] in the pool, width y's columns (loragate_kernels/reference.py `dora_scale_group`, the oracle). y holds
// the base projection plus the LoRA deltas; the result is DoRA's g (W x + s B A x) + bias. fp32 inside, y rounded
// once. One call per (layer, group) of a step with DoRA rows, against a torch op per segment, or a [rows, out] copy
// of the scales, that a decode step of 8 DoRA adapters measured at ~7% of its time.

constexpr int64_t kDoraGrain = 1 << 15;  // elements a thread takes at least (below, the call runs on one thread)

template <typename T>
void dora_row(T* row, const T* g, const float* bias, int64_t width) {
  if (bias == nullptr) {
    for (int64_t c = 0; c < width; ++c) store(&row[c], to_f(g[c]) * to_f(row[c]));
    return;
  }
  for (int64_t c = 0; c < width; ++c) {
    const float gc = to_f(g[c]);
    store(&row[c], gc * to_f(row[c]) + (1.f - gc) * bias[c]);
  }
}

template <typename T>
void dora_rows(const at::Tensor& y, const at::Tensor& pool, const std::vector<std::pair<int64_t, int64_t>>& rows,
               const float* bias) {
  T* out = static_cast<T*>(y.data_ptr());
  const T* weights = static_cast<const T*>(pool.data_ptr());
  const int64_t width = y.size(1), stride = y.stride(0);
  const int64_t grain = std::max<int64_t>(1, kDoraGrain / std::max<int64_t>(1, width));
  at::parallel_for(0, static_cast<int64_t>(rows.size()), grain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) dora_row<T>(out + rows[i].first * stride, weights + rows[i].second, bias, width);
  });
}

// The op: checks every argument (before anything is written), lists the (row, g offset) pairs, rescales them.
void dora_scale_group(at::Tensor y, const at::Tensor& segments, const at::Tensor& pool, const at::Tensor& g_offsets,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(y.dim() == 2 && y.device().is_cpu() && pool.device().is_cpu(), "y must be a [T, out] CPU tensor");
  TORCH_CHECK(y.scalar_type() == pool.scalar_type(), "y and pool must share a dtype");
  TORCH_CHECK(y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16 || y.scalar_type() == at::kHalf,
              "float32, bfloat16 or float16 only, not ", y.scalar_type());
  TORCH_CHECK(y.stride(1) == 1, "y needs contiguous columns");
  TORCH_CHECK(pool.dim() == 1 && pool.is_contiguous(), "pool must be a contiguous 1-D tensor");
  TORCH_CHECK(segments.dim() == 1 && segments.numel() % 2 == 1, "segments must be [2 S + 1]: S + 1 starts, S slots");
  TORCH_CHECK(g_offsets.dim() == 1, "g_offsets must be [slots]");
  const int64_t num_segs = segments.numel() / 2, num_slots = g_offsets.numel(), width = y.size(1);
  const int64_t* starts = ints(segments, "segments");
  const int64_t* slots = starts + num_segs + 1;
  const int64_t* offsets = ints(g_offsets, "g_offsets");
  thread_local std::vector<float> bias_of_thread;
  const float* bias_f = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == width && bias->device().is_cpu(), "bias must be [out] on the CPU");
    const at::Tensor b = bias->to(at::kFloat).contiguous();
    bias_of_thread.assign(b.data_ptr<float>(), b.data_ptr<float>() + width);
    bias_f = bias_of_thread.data();
  }
  thread_local std::vector<std::pair<int64_t, int64_t>> rows_of_thread;
  std::vector<std::pair<int64_t, int64_t>>& rows = rows_of_thread;
  rows.clear();
  for (int64_t s = 0; s < num_segs; ++s) {
    TORCH_CHECK(starts[s] >= 0 && starts[s] <= starts[s + 1] && starts[s + 1] <= y.size(0),
                "segment starts must be nondecreasing within [0, ", y.size(0), "]");
    const int64_t k = slots[s];
    TORCH_CHECK(k >= 0 && k < num_slots, "segment ", s, " names slot ", k, " of ", num_slots);
    if (offsets[k] < 0) continue;
    TORCH_CHECK(offsets[k] + width <= pool.numel(), "slot ", k, "'s row scales overrun the pool");
    for (int64_t r = starts[s]; r < starts[s + 1]; ++r) rows.emplace_back(r, offsets[k]);
  }
  if (rows.empty()) return;
  switch (y.scalar_type()) {
    case at::kFloat: dora_rows<float>(y, pool, rows, bias_f); break;
    case at::kBFloat16: dora_rows<c10::BFloat16>(y, pool, rows, bias_f); break;
    default: dora_rows<c10::Half>(y, pool, rows, bias_f); break;  // checked above: these three only
  }
}

}  // namespace

void loragate_cpu::add_lora(at::Tensor& y, const at::Tensor& x, const at::Tensor& segments, const at::Tensor& pool,
                            const at::Tensor& block, at::IntArrayRef out_cols) {
  lora_sgmv_group(y, x, segments, pool, block, out_cols);
}

TORCH_LIBRARY(loragate_cpu, m) {
  m.def(
      "lora_sgmv_group(Tensor(a!) y, Tensor x, Tensor segments, Tensor pool, Tensor block, int[] out_cols) -> ()");
  m.def("dora_scale_group(Tensor(a!) y, Tensor segments, Tensor pool, Tensor g_offsets, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(loragate_cpu, CPU, m) {
  m.impl("lora_sgmv_group", &lora_sgmv_group);
  m.impl("dora_scale_group", &dora_scale_group);
}
