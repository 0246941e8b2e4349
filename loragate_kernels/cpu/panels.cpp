// The CPU path's fp32 GEMM over a panel layout of the weight, for CPUs with AVX-512 (loragate_kernels/cpu/build.py
// builds this file; loragate_kernels/backends.py decides where it runs; F.linear is its oracle in
// tests/kernels/test_cpu_panels.py):
//
//   panel_pack_weight(weight)                  weight [N, K] fp32 -> panels [ceil(N / 96), K, 96], zero-padded
//   panel_linear(x, panels, bias, n)           x [M, K] @ weight^T (+ bias [n]) -> new [M, n] fp32
//   panel_linear_silu(x, panels, bias, n)      the same for a [gate; up] weight, then silu(gate) * up -> new [M, n / 2]
//                                              (cpu/layer.cpp's silu_mul, fused: the MLP's first GEMM without LoRA)
//   panel_linear_lora(x, panels, bias, n, segments, pool, block, out_cols)
//                                              the same with a LoRA group added (cpu/lora.cpp's op, one call)
//   panels_ready()                             whether this build has the kernel (a CPU with AVX-512)
//
// A panel is 96 output columns of the weight, all of K, stored k-major: the 96 weights of one K column are one
// contiguous run of 6 vectors. A tile multiplies 4 rows of x by a panel: for each k, x[m, k] broadcast against the 6
// vectors, 24 sums in registers and no horizontal sums (cpu/gemm.cpp's row-major kernel folds 24 sums across lanes at
// the end of every tile, a fifth of its instructions at K = 576). The sums of PANEL_K columns at a time join the tile's
// running sums in memory, so no sum runs over more than PANEL_K products in sequence (the error stays near the
// row-major kernel's). A thread takes consecutive panels, one sequential stream, and while it computes one it asks for
// the next a few lines at a time. Every row count runs here: a prompt step re-reads a panel from L2 for each 4 rows,
// and one copy of the weight serves decode and prefill. It runs ahead of cpu/gemm.cpp at decode row counts and of
// oneDNN at prefill row counts (docs/performance.md, *GEMMs, route by route*, has the figures).
//
// Two compiler traps, both measured: with the K-block loop inside the tile, GCC spills the 6 weight vectors to the
// stack (`block` is not inlined, so its registers are its own); without the empty asm that pins them, it folds the
// loads into 24 memory-operand FMAs.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <type_traits>
#include <utility>

#include "common.h"
#include "lora.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t PANEL = 96;   // output columns a panel holds: 6 vectors of 16
constexpr int64_t PANEL_K = 64;  // K columns a tile sums in registers before they join its running sums

bool panels_ready() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512F__)
using loragate_cpu::Ahead;  // the thread's next panel, asked for a few lines per 8 columns of K

// part[m] (+)= x[m, k0 : k1] . the panel's columns for m < MT: the sums in registers (24 at 4 rows), added to `part`
// (the tile's running sums) at the end, or stored there when `first`. Not inlined: its registers are its own.
template <int MT>
__attribute__((noinline)) void block(const float* x, int64_t ldx, const float* panel, int64_t k0, int64_t k1,
                                     float (*part)[PANEL], bool first, Ahead& ahead) {
  __m512 acc[MT][6];
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 6
    for (int v = 0; v < 6; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t kk = k0; kk < k1; ++kk) {
    if ((kk & 7) == 0) ahead.issue();
    __m512 w[6];
#pragma GCC unroll 6
    for (int v = 0; v < 6; ++v) {
      w[v] = _mm512_loadu_ps(panel + kk * PANEL + 16 * v);
      asm volatile("" : "+v"(w[v]));  // kept in a register: not folded into each FMA as a load
    }
#pragma GCC unroll 4
    for (int m = 0; m < MT; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * ldx + kk]);
#pragma GCC unroll 6
      for (int v = 0; v < 6; ++v) acc[m][v] = _mm512_fmadd_ps(w[v], xb, acc[m][v]);
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 6
    for (int v = 0; v < 6; ++v)
      _mm512_store_ps(&part[m][16 * v], first ? acc[m][v] : _mm512_add_ps(_mm512_load_ps(&part[m][16 * v]), acc[m][v]));
}

// y[m, 0 : width] = x[m] . the panel's columns (+ bias) for m < MT, PANEL_K columns of K a block.
template <int MT>
void tile(const float* x, int64_t ldx, const float* panel, int64_t k, const float* bias, float* y, int64_t ldy,
          int64_t width, Ahead& ahead) {
  alignas(64) float part[MT][PANEL];
  for (int64_t k0 = 0; k0 < k; k0 += PANEL_K) block<MT>(x, ldx, panel, k0, std::min(k, k0 + PANEL_K), part, k0 == 0, ahead);
  for (int v = 0; v < 6 && 16 * v < width; ++v) {
    const int64_t left = width - 16 * v;
    const __mmask16 live = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(live, bias + 16 * v) : _mm512_setzero_ps();
    for (int m = 0; m < MT; ++m)
      _mm512_mask_storeu_ps(y + m * ldy + 16 * v, live, _mm512_add_ps(_mm512_load_ps(&part[m][16 * v]), b));
  }
}

// fn(p, r0, r1, ask) for every work item: group p of panels (one panel, or a gate/up pair) over rows [r0, r1), split
// across the threads. One run of every row where the groups alone keep every thread busy (2 threads: every GEMM of
// SmolLM2), more where they are fewer than twice the threads, or few and not a multiple of the threads: 7 panels
// (hidden 640, Gemma 3 270M's o and down projections) ran 4 on one thread against 3 on the other, and as 14 half
// items they run 7 and 7 (down, 32 rows: 0.52 -> 0.41 ms). A thread's items are consecutive, so the two runs of a
// panel mostly fall to one thread, the second reading it from L2. `ask`: the thread's next item starts the next
// group, whose panels are worth asking for while this one computes.
template <typename F>
void for_items(int64_t m, int64_t groups, const F& fn) {
  const int64_t m_tiles = (m + 3) / 4, threads = at::get_num_threads();
  int64_t runs = groups >= 2 * threads ? 1 : std::min(m_tiles, (2 * threads + groups - 1) / groups);
  if (runs == 1 && groups % threads != 0 && groups < 16 * threads)
    runs = std::min(m_tiles, threads / std::gcd(groups, threads));
  const int64_t run_rows = 4 * ((m_tiles + runs - 1) / runs);
  runs = (m + run_rows - 1) / run_rows;
  at::parallel_for(0, groups * runs, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t p = item / runs, r0 = (item % runs) * run_rows;
      fn(p, r0, std::min(m, r0 + run_rows), item + 1 < hi && (item + 1) / runs != p);
    }
  });
}

// fn(std::integral_constant<int, MT>{}, m0) for the tiles of rows [r0, r1): MT = 4 rows each, fewer in the last.
template <typename F>
void for_tiles(int64_t r0, int64_t r1, const F& fn) {
  for (int64_t m0 = r0; m0 < r1; m0 += 4) {
    switch (std::min<int64_t>(4, r1 - m0)) {
      case 4: fn(std::integral_constant<int, 4>{}, m0); break;
      case 3: fn(std::integral_constant<int, 3>{}, m0); break;
      case 2: fn(std::integral_constant<int, 2>{}, m0); break;
      default: fn(std::integral_constant<int, 1>{}, m0); break;
    }
  }
}

// An Ahead over `panel` (panel_elems floats), spread over the passes of an item's tiles of rows [r0, r1).
Ahead ahead_over(const float* panel, int64_t panel_elems, int64_t r0, int64_t r1, int64_t k) {
  return Ahead::over(panel, panel_elems * static_cast<int64_t>(sizeof(float)), (r1 - r0 + 3) / 4 * ((k + 7) / 8));
}

// y [m, n] = x . the panels (+ bias).
void multiply(const float* x, int64_t ldx, int64_t m, const float* panels, int64_t num_panels, int64_t k,
              const float* bias, float* y, int64_t n) {
  const int64_t panel_elems = k * PANEL;
  for_items(m, num_panels, [&](int64_t p, int64_t r0, int64_t r1, bool ask) {
    const float* panel = panels + p * panel_elems;
    Ahead ahead = ask ? ahead_over(panel + panel_elems, panel_elems, r0, r1, k) : Ahead{};
    const int64_t c0 = p * PANEL, width = std::min(PANEL, n - c0);
    const float* b = bias ? bias + c0 : nullptr;
    for_tiles(r0, r1, [&](auto mt, int64_t m0) {
      tile<decltype(mt)::value>(x + m0 * ldx, ldx, panel, k, b, y + m0 * n + c0, n, width, ahead);
    });
  });
}

// y [m, half] = silu(x . gate panels (+ bias)) * (x . up panels (+ bias)), the weight's rows [gate; up] and half =
// 96 pairs: pair p is gate panel p and up panel p + pairs. Per tile, both panels' sums wait in L1 for the activation
// (cpu/common.h `silu_mul16`), 16 columns at a time; an item asks for the next pair's two panels, each over its own
// tiles' passes.
void multiply_silu(const float* x, int64_t ldx, int64_t m, const float* panels, int64_t pairs, int64_t k,
                   const float* bias, float* y) {
  const int64_t panel_elems = k * PANEL, half = pairs * PANEL;
  for_items(m, pairs, [&](int64_t p, int64_t r0, int64_t r1, bool ask) {
    const float* gate = panels + p * panel_elems;
    const float* up = gate + pairs * panel_elems;
    Ahead ahead_gate = ask ? ahead_over(gate + panel_elems, panel_elems, r0, r1, k) : Ahead{};
    Ahead ahead_up = ask ? ahead_over(up + panel_elems, panel_elems, r0, r1, k) : Ahead{};
    const float* gate_bias = bias ? bias + p * PANEL : nullptr;
    const float* up_bias = bias ? bias + half + p * PANEL : nullptr;
    for_tiles(r0, r1, [&](auto mt, int64_t m0) {
      constexpr int MT = decltype(mt)::value;
      alignas(64) float g[MT][PANEL], u[MT][PANEL];
      tile<MT>(x + m0 * ldx, ldx, gate, k, gate_bias, &g[0][0], PANEL, PANEL, ahead_gate);
      tile<MT>(x + m0 * ldx, ldx, up, k, up_bias, &u[0][0], PANEL, PANEL, ahead_up);
      float* yt = y + m0 * half + p * PANEL;
      for (int r = 0; r < MT; ++r)
        for (int v = 0; v < 6; ++v)
          _mm512_storeu_ps(yt + r * half + 16 * v,
                           loragate_cpu::silu_mul16(_mm512_load_ps(&g[r][16 * v]), _mm512_load_ps(&u[r][16 * v])));
    });
  });
}
#endif

at::Tensor panel_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "weight must be a 2-D float32 CPU tensor");
  const int64_t n = weight.size(0), k = weight.size(1), num_panels = (n + PANEL - 1) / PANEL;
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::zeros({num_panels, k, PANEL}, weight.options());
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, num_panels, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p) {
      const int64_t cols = std::min(PANEL, n - p * PANEL);
      for (int64_t kk = 0; kk < k; ++kk)  // written in order; the panel's rows read in lockstep, a line each per 16 k
        for (int64_t c = 0; c < cols; ++c) dst[(p * k + kk) * PANEL + c] = src[(p * PANEL + c) * k + kk];
    }
  });
  return out;
}

// x (columns contiguous) and the bias's pointer (or null), after checking both against panels of an [n, K] weight.
std::pair<at::Tensor, const float*> checked(const char* op, const at::Tensor& x_in, const at::Tensor& panels,
                                            const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(panels_ready(), op, ": this build has no AVX-512");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.is_contiguous() &&
                  panels.device().is_cpu() && panels.size(2) == PANEL,
              "panels must be panel_pack_weight's [ceil(N / 96), K, 96]");
  TORCH_CHECK(n > (panels.size(0) - 1) * PANEL && n <= panels.size(0) * PANEL, "n = ", n, " does not fit ",
              panels.size(0), " panels");
  TORCH_CHECK(x_in.size(1) == panels.size(1), "x has ", x_in.size(1), " columns, the weight ", panels.size(1));
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() && bias->scalar_type() == at::kFloat,
                "bias must be a contiguous float32 [", n, "]");
    bias_ptr = bias->data_ptr<float>();
  }
  return {x_in.stride(1) == 1 ? x_in : x_in.contiguous(), bias_ptr};
}

at::Tensor panel_linear(const at::Tensor& x_in, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                        int64_t n) {
  const auto [x, bias_ptr] = checked("panel_linear", x_in, panels, bias, n);
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor y = at::empty({m, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (m == 0 || n == 0) return y;
  if (k == 0) return bias_ptr ? y.copy_(bias->expand({m, n})) : y.zero_();
#if defined(__AVX512F__)
  multiply(x.data_ptr<float>(), x.stride(0), m, panels.data_ptr<float>(), panels.size(0), k, bias_ptr,
           y.data_ptr<float>(), n);
#endif
  return y;
}

// out[m, i] = panel_linear(x, panels, bias, n)[m, cols[m, i]], to the bit, for the few columns each row lists (-1:
// none, -inf out): each one's sums in panel_linear's order (blocks of PANEL_K products, one fused multiply-add each, a
// block's sum then added to the running sum, then the bias), a row's columns 8 at a time so their reads overlap.
// The greedy head screen's exact step (engine/model/head_screen.py).
at::Tensor panel_columns(const at::Tensor& x_in, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                         int64_t n, const at::Tensor& cols) {
  const auto [x, bias_ptr] = checked("panel_columns", x_in, panels, bias, n);
  TORCH_CHECK(cols.dim() == 2 && cols.size(0) == x.size(0) && cols.scalar_type() == at::kLong && cols.is_contiguous(),
              "cols must be a contiguous int64 [", x.size(0), ", C]");
  const int64_t m = x.size(0), k = x.size(1), width = cols.size(1);
  const int64_t* col = cols.data_ptr<int64_t>();
  for (int64_t i = 0; i < m * width; ++i)
    TORCH_CHECK(col[i] >= -1 && col[i] < n, "column ", col[i], " is outside the weight's ", n, " rows");
  at::Tensor out = at::empty({m, width}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const float* xs = x.data_ptr<float>();
  const float* base = panels.data_ptr<float>();
  float* y = out.data_ptr<float>();
  constexpr int64_t LANES = 8;
  at::parallel_for(0, m * ((width + LANES - 1) / LANES), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t row = item / ((width + LANES - 1) / LANES), i0 = item % ((width + LANES - 1) / LANES) * LANES;
      const float* xr = xs + row * x.stride(0);
      const float* w[LANES];
      float part[LANES], acc[LANES];
      for (int64_t l = 0; l < LANES; ++l) {
        const int64_t c = i0 + l < width ? col[row * width + i0 + l] : -1;
        w[l] = c < 0 ? nullptr : base + (c / PANEL) * k * PANEL + c % PANEL;
        part[l] = 0.0f;
      }
      for (int64_t k0 = 0; k0 < k; k0 += PANEL_K) {
        for (int64_t l = 0; l < LANES; ++l) acc[l] = 0.0f;
        const int64_t k1 = std::min(k, k0 + PANEL_K);
        for (int64_t kk = k0; kk < k1; ++kk)
          for (int64_t l = 0; l < LANES; ++l)
            if (w[l] != nullptr) acc[l] = std::fma(w[l][kk * PANEL], xr[kk], acc[l]);
        for (int64_t l = 0; l < LANES; ++l) part[l] = k0 == 0 ? acc[l] : part[l] + acc[l];
      }
      for (int64_t l = 0; l < LANES && i0 + l < width; ++l) {
        const int64_t c = col[row * width + i0 + l];
        y[row * width + i0 + l] = c < 0 ? -INFINITY : part[l] + (bias_ptr ? bias_ptr[c] : 0.0f);
      }
    }
  });
  return out;
}

// panel_linear of a [gate; up] weight with cpu/layer.cpp's silu_mul on its output, in one pass: equal to
// silu_mul(panel_linear(x, panels, bias, n)) to the bit, without the [M, n] product in memory.
at::Tensor panel_linear_silu(const at::Tensor& x_in, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                             int64_t n) {
  const auto [x, bias_ptr] = checked("panel_linear_silu", x_in, panels, bias, n);
  TORCH_CHECK(n % (2 * PANEL) == 0, "panel_linear_silu: n = ", n, " is not a multiple of ", 2 * PANEL,
              " (gate and up must each fill whole panels)");
  const int64_t m = x.size(0), k = x.size(1), half = n / 2;
  TORCH_CHECK(k > 0, "panel_linear_silu: the weight has no columns");
  at::Tensor y = at::empty({m, half}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (m == 0 || n == 0) return y;
#if defined(__AVX512F__)
  multiply_silu(x.data_ptr<float>(), x.stride(0), m, panels.data_ptr<float>(), half / PANEL, k, bias_ptr,
                y.data_ptr<float>());
#endif
  return y;
}

// panel_linear with a group's LoRA added, in one call (as cpu/gemm.cpp's skinny_linear_lora).
at::Tensor panel_linear_lora(const at::Tensor& x_in, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                             int64_t n, const at::Tensor& segments, const at::Tensor& pool, const at::Tensor& block,
                             at::IntArrayRef out_cols) {
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  at::Tensor y = panel_linear(x, panels, bias, n);
  loragate_cpu::add_lora(y, x, segments, pool, block, out_cols);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate_cpu, m) {
  m.def("panels_ready() -> bool", &panels_ready);  // no tensor arguments: one kernel for every dispatch key
  m.def("panel_pack_weight(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias, int n) -> Tensor");
  m.def("panel_linear_silu(Tensor x, Tensor panels, Tensor? bias, int n) -> Tensor");
  m.def("panel_columns(Tensor x, Tensor panels, Tensor? bias, int n, Tensor cols) -> Tensor");
  m.def(
      "panel_linear_lora(Tensor x, Tensor panels, Tensor? bias, int n, Tensor segments, Tensor pool, Tensor block, "
      "int[] out_cols) -> Tensor");
}

TORCH_LIBRARY_IMPL(loragate_cpu, CPU, m) {
  m.impl("panel_pack_weight", &panel_pack_weight);
  m.impl("panel_linear", &panel_linear);
  m.impl("panel_linear_silu", &panel_linear_silu);
  m.impl("panel_columns", &panel_columns);
  m.impl("panel_linear_lora", &panel_linear_lora);
}
