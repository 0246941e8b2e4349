// The greedy screen of a wide fp32 LM head (loragate_kernels/cpu/build.py builds this file; engine/model/head_screen.py
// calls it, proves its bound, and with cpu/panels.cpp's `panel_columns` after it is tested against the full fp32 head's
// argmax in tests/kernels/test_cpu_screen.py):
//
//   screen_pack(weight)     weight [N, K] fp32 -> bf16 [ceil(N / 96), K / 2, 96, 2], zero-padded (K even)
//   screen_columns(x, packed, norms, slack, banned, n_valid, cap) -> (cols [M, C] int64, counts [M] int64)
//       for each row m of x [M, K] bf16: the columns j < n_valid, not in `banned` ([n] int64), whose bf16 logit a
//       (x[m] . bf16 weight[j], summed in fp32) plus its bound e = slack[m] * norms[j] reaches L, the largest a - e over
//       those columns; ascending, padded with -1. counts[m]: how many, -1 where more than `cap` (the row is void).
//   screen_ready()          whether this build has the kernel (a CPU with AVX-512 bf16)
//
// The kernel is cpu/amx.cpp's dot kernel on a layout of its own: a panel is 96 output columns, and one K pair of the
// panel is one contiguous run of 6 vectors (each lane a bf16 pair, what the dot instruction multiplies against a
// broadcast pair of x), so a tile of 4 rows reads one sequential stream per panel, as cpu/panels.cpp's fp32 tile does.
// The layout of cpu/amx.cpp, shared with the AMX tiles, spreads the same 6 vectors over 6 streams, and its screen ran
// at 0.8x this one's rate (docs/performance.md, *The greedy head screen*). A thread takes consecutive panels and asks
// for the next one while it computes the current one.
//
// The logits never reach memory: per tile, the epilogue folds a - e into the row's running L (of the thread's columns
// so far) and appends the columns whose a + e reach it to the row's buffer, with their a + e; a full buffer first
// drops the pairs that fell below the running L. The threads' buffers then merge in column order under the rows'
// final L: the same set as two passes over every logit.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "common.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define LORAGATE_SCREEN 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t COLS = 96;  // output columns a panel holds: 6 vectors of 16 sums

bool screen_ready() {
#if defined(LORAGATE_SCREEN)
  return true;
#else
  return false;
#endif
}

// What the threads keep per part (a run of panels) and row.
struct Held {
  int64_t m, cap;
  std::vector<float> floor;    // [parts, m]: the part's running L per row
  std::vector<int32_t> count;  // [parts, m]: pairs held (cap + 1: overflowed)
  std::vector<int32_t> cols;   // [parts, m, cap]
  std::vector<float> highs;    // [parts, m, cap]: a + e of each
  Held(int64_t parts, int64_t m, int64_t cap)
      : m(m), cap(cap), floor(parts * m, -INFINITY), count(parts * m, 0), cols(parts * m * cap), highs(parts * m * cap) {}
};

#if defined(LORAGATE_SCREEN)
using loragate_cpu::Ahead;  // the thread's next panel, asked for a few lines per 16 K pairs

// sums[m][c] = x[m] . the panel's column c for m < MT: MT x 6 vectors of sums in registers (no horizontal sums), then
// stored for finish(sums): the accumulators' address never escapes, so they stay in registers.
template <int MT, typename Finish>
inline void tile(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* panel, int64_t pairs, Ahead& ahead,
                 const Finish& finish) {
  __m512 acc[MT][6];
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 6
    for (int v = 0; v < 6; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < pairs; ++kp) {
    if ((kp & 15) == 0) ahead.issue();
    __m512i w[6];
#pragma GCC unroll 6
    for (int v = 0; v < 6; ++v) {
      w[v] = _mm512_loadu_si512(panel + (kp * COLS + 16 * v) * 2);
      asm volatile("" : "+v"(w[v]));  // kept in a register: not folded into each dot as a load
    }
#pragma GCC unroll 4
    for (int m = 0; m < MT; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * kp, sizeof pair);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 6
      for (int v = 0; v < 6; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], (__m512bh)w[v], xb);
    }
  }
  alignas(64) float sums[MT][COLS];
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 6
    for (int v = 0; v < 6; ++v) _mm512_store_ps(&sums[m][16 * v], acc[m][v]);
  finish(sums);
}

// The tile's epilogue: rows m0 .. m0 + MT against columns c0 .. c0 + 96 into part `slot0 / m` of `held`.
template <int MT>
__attribute__((noinline)) void fold(const float (&sums)[MT][COLS], int64_t m0, int64_t c0, int64_t part, const float* norms, const float* slack,
          const int64_t* banned, int64_t num_banned, int64_t n_valid, Held& held) {
  __mmask16 live[6];
  __m512 norm[6];
#pragma GCC unroll 6
  for (int v = 0; v < 6; ++v) {
    const int64_t left = n_valid - (c0 + 16 * v);
    live[v] = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>(left <= 0 ? 0u : (1u << left) - 1);
    norm[v] = live[v] ? _mm512_maskz_loadu_ps(live[v], norms + c0 + 16 * v) : _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < num_banned; ++b) {
    const int64_t j = banned[b] - c0;
    if (j >= 0 && j < COLS) live[j / 16] &= static_cast<__mmask16>(~(1u << (j % 16)));
  }
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const int64_t cap = held.cap;
  for (int r = 0; r < MT; ++r) {
    const int64_t slot = part * held.m + m0 + r;
    const __m512 s = _mm512_set1_ps(slack[m0 + r]);
    // a - e <= a + e: where no a + e reaches the running L (most tiles, once L has risen), L stays and nothing is kept
    const __m512 floor0 = _mm512_set1_ps(held.floor[slot]);
    __mmask16 reach = 0;
#pragma GCC unroll 6
    for (int v = 0; v < 6; ++v)
      reach |= live[v] & _mm512_cmp_ps_mask(_mm512_fmadd_ps(s, norm[v], _mm512_load_ps(&sums[r][16 * v])), floor0,
                                            _CMP_GE_OQ);
    if (reach == 0) continue;
    __m512 lows = _mm512_set1_ps(-INFINITY);
#pragma GCC unroll 6
    for (int v = 0; v < 6; ++v)
      lows = _mm512_mask_max_ps(lows, live[v], lows, _mm512_fnmadd_ps(s, norm[v], _mm512_load_ps(&sums[r][16 * v])));  // a - e
    const float low = std::max(held.floor[slot], _mm512_reduce_max_ps(lows));
    held.floor[slot] = low;
    const __m512 floor = _mm512_set1_ps(low);
    int32_t count = held.count[slot];
    int32_t* cols = held.cols.data() + slot * cap;
    float* highs = held.highs.data() + slot * cap;
    for (int v = 0; v < 6; ++v) {
      const __m512 high = _mm512_fmadd_ps(s, norm[v], _mm512_load_ps(&sums[r][16 * v]));  // a + e
      const __mmask16 keep = live[v] & _mm512_cmp_ps_mask(high, floor, _CMP_GE_OQ);
      if (keep == 0 || count > cap) continue;
      if (count + 16 > cap) {  // full: drop what fell below the running L
        int32_t kept = 0;
        for (int32_t i = 0; i < count; ++i)
          if (highs[i] >= low) cols[kept] = cols[i], highs[kept++] = highs[i];
        count = kept + 16 > cap ? static_cast<int32_t>(cap) + 1 : kept;
        if (count > cap) continue;
      }
      const __m512i at = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(c0 + 16 * v)));
      _mm512_mask_compressstoreu_epi32(cols + count, keep, at);
      _mm512_mask_compressstoreu_ps(highs + count, keep, high);
      count += __builtin_popcount(keep);
    }
    held.count[slot] = count;
  }
}

void screen_rows(const c10::BFloat16* x, int64_t ldx, int64_t m, const c10::BFloat16* packed, int64_t panels,
                 int64_t pairs, const float* norms, const float* slack, const int64_t* banned, int64_t num_banned,
                 int64_t n_valid, int64_t parts, Held& held) {
  const int64_t panel_elems = pairs * COLS * 2, m_tiles = (m + 3) / 4;
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t part = p0; part < p1; ++part) {
      const int64_t lo = panels * part / parts, hi = panels * (part + 1) / parts;
      for (int64_t p = lo; p < hi; ++p) {
        const c10::BFloat16* panel = packed + p * panel_elems;
        const int64_t steps = m_tiles * ((pairs + 15) / 16);  // the next panel, over this one's passes
        Ahead ahead = p + 1 < hi ? Ahead::over(panel + panel_elems, panel_elems * 2, steps) : Ahead{};
        for (int64_t m0 = 0; m0 < m; m0 += 4) {
          auto run = [&](auto mt) {
            constexpr int MT = decltype(mt)::value;
            tile<MT>(x + m0 * ldx, ldx, panel, pairs, ahead, [&](const float(&sums)[MT][COLS]) {
              fold<MT>(sums, m0, p * COLS, part, norms, slack, banned, num_banned, n_valid, held);
            });
          };
          switch (std::min<int64_t>(4, m - m0)) {
            case 4: run(std::integral_constant<int, 4>{}); break;
            case 3: run(std::integral_constant<int, 3>{}); break;
            case 2: run(std::integral_constant<int, 2>{}); break;
            default: run(std::integral_constant<int, 1>{}); break;
          }
        }
      }
    }
  });
}
#endif

at::Tensor screen_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "weight must be a 2-D float32 CPU tensor");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + COLS - 1) / COLS;
  TORCH_CHECK(k % 2 == 0, "the weight's K (", k, ") must be even");
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::zeros({panels, k / 2, COLS, 2}, weight.options().dtype(at::kBFloat16));
  const float* src = w.data_ptr<float>();
  c10::BFloat16* dst = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, panels, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p)
      for (int64_t c = 0; c < std::min(COLS, n - p * COLS); ++c)
        for (int64_t kk = 0; kk < k; ++kk)  // rounded to nearest even, as torch's conversion
          dst[((p * (k / 2) + kk / 2) * COLS + c) * 2 + kk % 2] = c10::BFloat16(src[(p * COLS + c) * k + kk]);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> screen_columns(const at::Tensor& x, const at::Tensor& packed,
                                                  const at::Tensor& norms, const at::Tensor& slack,
                                                  const at::Tensor& banned, int64_t n_valid, int64_t cap) {
  TORCH_CHECK(screen_ready(), "screen_columns: this build has no AVX-512 bf16 dot instruction");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu() && x.stride(1) == 1,
              "x must be a 2-D bf16 CPU tensor with contiguous columns");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == COLS && packed.size(3) == 2,
              "packed must be screen_pack's [ceil(N / 96), K / 2, 96, 2]");
  const int64_t m = x.size(0), panels = packed.size(0), pairs = packed.size(1), n = panels * COLS;
  TORCH_CHECK(x.size(1) == 2 * pairs, "x has ", x.size(1), " columns, the weight ", 2 * pairs);
  TORCH_CHECK(0 < n_valid && n_valid <= n && n_valid < (int64_t{1} << 31), "n_valid must be in (0, ", n, "]");
  TORCH_CHECK(norms.dim() == 1 && norms.size(0) >= n_valid && norms.scalar_type() == at::kFloat &&
                  norms.is_contiguous(),
              "norms must be a contiguous float32 [n_valid]");
  TORCH_CHECK(slack.dim() == 1 && slack.size(0) == m && slack.scalar_type() == at::kFloat && slack.is_contiguous(),
              "slack must be a contiguous float32 [", m, "]");
  TORCH_CHECK(banned.dim() == 1 && banned.scalar_type() == at::kLong && banned.is_contiguous(),
              "banned must be a contiguous int64 [n]");
  const int64_t* ban = banned.data_ptr<int64_t>();
  for (int64_t i = 0; i < banned.numel(); ++i)
    TORCH_CHECK(0 <= ban[i] && ban[i] < n_valid, "banned id ", ban[i], " is outside the vocabulary");
  TORCH_CHECK(cap >= 16 && cap < (int64_t{1} << 30), "cap must be at least 16");
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), panels));
  Held held(parts, std::max<int64_t>(m, 1), cap);
#if defined(LORAGATE_SCREEN)
  if (m > 0)
    screen_rows(x.data_ptr<c10::BFloat16>(), x.stride(0), m, packed.data_ptr<c10::BFloat16>(), panels, pairs,
                norms.data_ptr<float>(), slack.data_ptr<float>(), ban, banned.numel(), n_valid, parts, held);
#endif
  at::Tensor counts = at::empty({m}, x.options().dtype(at::kLong));
  int64_t* count = counts.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> kept(m);
  for (int64_t row = 0; row < m; ++row) {
    float floor = -INFINITY;
    bool over = false;
    for (int64_t part = 0; part < parts; ++part) {
      floor = std::max(floor, held.floor[part * m + row]);
      over = over || held.count[part * m + row] > cap;
    }
    if (!over)
      for (int64_t part = 0; part < parts; ++part) {
        const int64_t slot = part * m + row;
        for (int32_t i = 0; i < held.count[slot]; ++i)
          if (held.highs[slot * cap + i] >= floor) kept[row].push_back(held.cols[slot * cap + i]);
      }
    over = over || static_cast<int64_t>(kept[row].size()) > cap;
    if (over) kept[row].clear();
    count[row] = over ? -1 : static_cast<int64_t>(kept[row].size());
  }
  int64_t width = 1;
  for (const auto& row : kept) width = std::max<int64_t>(width, static_cast<int64_t>(row.size()));
  at::Tensor cols = at::full({m, width}, -1, x.options().dtype(at::kLong));
  int64_t* out = cols.data_ptr<int64_t>();
  for (int64_t row = 0; row < m; ++row) std::copy(kept[row].begin(), kept[row].end(), out + row * width);
  return {cols, counts};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate_cpu, m) {
  m.def("screen_ready() -> bool", &screen_ready);  // no tensor arguments: one kernel for every dispatch key
  m.def("screen_pack(Tensor weight) -> Tensor");
  m.def(
      "screen_columns(Tensor x, Tensor packed, Tensor norms, Tensor slack, Tensor banned, int n_valid, int cap) -> "
      "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(loragate_cpu, CPU, m) {
  m.impl("screen_pack", &screen_pack);
  m.impl("screen_columns", &screen_columns);
}
