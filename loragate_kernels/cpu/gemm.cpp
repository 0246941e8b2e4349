// The CPU path's GEMM for few rows against a weight that streams from memory (loragate_kernels/cpu/build.py builds this
// file; loragate_kernels/backends.py decides where it runs; F.linear is its oracle in tests/kernels/test_cpu_gemm.py):
//
//   skinny_linear(x, weight, bias)   x [M, K] @ weight[N, K]^T (+ bias [N])   -> new [M, N], fp32
//
// A decode step multiplies tens of rows by every weight of the model once: each weight byte is used M times, and is
// read from DRAM (a model is far larger than the caches). oneDNN's kernels keep the FMA units busy once the weight is
// in cache, but stall on its first read: W1's decode GEMMs (M = 32) streamed at well under half the rate a plain sum
// reads (docs/performance.md, *GEMMs, route by route*, has the figures). This op reads the weight in blocks of
// CHUNK_ROWS rows x at most MAX_BLOCK_K columns (in L2 with the block's rows of x), and while it computes one block it
// prefetches the next one into L2, a few lines per 64 columns of every tile, so the next block's reads are hits.
//
// A tile is the dot products of TILE_M rows of x with up to Isa::MAX_R rows of the weight, one vector of columns at
// a time, reduced horizontally once per block: with AVX-512 (32 registers) 4 x 6 accumulators, 6 weight vectors
// and 1 x vector; with AVX2 (16) 4 x 3. A block's last columns that do not fill a vector are read with masked
// loads. A chunk's sums over its blocks gather in a small buffer, and go to y with the bias once.
// The weight keeps its row-major layout (no reorder; the oneDNN route for larger row counts reads the same tensor).
// Without AVX2 and FMA the same blocking runs as plain loops the compiler vectorizes (fp32 only).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "lora.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t TILE_M = 4;
constexpr int64_t MAX_BLOCK_K = 1024;  // columns per block: 48 rows x 1024 x 4 B = 192 KB of fp32 weight
constexpr int64_t PF_COLS = 64;        // columns between two prefetch issues
constexpr int64_t LINE = 64;

// The lines of the next block, issued a few at a time: `rows` rows of `row_bytes` bytes, `stride` bytes apart.
struct Prefetcher {
  const char* row = nullptr;
  int64_t row_bytes = 0;
  int64_t stride = 0;
  int64_t rows = 0;
  int64_t offset = 0;

  inline __attribute__((always_inline)) void issue(int64_t lines) {
    for (; lines > 0 && rows > 0; --lines) {
      __builtin_prefetch(row + offset, 0, 2);  // prefetcht1: into L2
      offset += LINE;
      if (offset >= row_bytes) {
        offset = 0;
        row += stride;
        --rows;
      }
    }
  }
};

// The instruction sets: STEP the columns one vector holds, MAX_R the weight rows a tile takes. `dot(acc, x, w)`
// adds the products of one vector of columns to acc's lanes; `tail(p, n)` loads n < STEP columns with zeros after
// them; `pin` keeps a loaded vector in a register (the compiler would rather fold the load into every instruction
// that reads it, and then L1's ports, not the arithmetic, would set the pace).
#if defined(__AVX512F__)
struct Avx512F32 {
  using Acc = __m512;
  using In = __m512;
  static constexpr int64_t STEP = 16, MAX_R = 6;
  static Acc zero() { return _mm512_setzero_ps(); }
  static In load(const float* p) { return _mm512_loadu_ps(p); }
  static In tail(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p); }
  static Acc dot(Acc a, In x, In w) { return _mm512_fmadd_ps(x, w, a); }
  static float sum(Acc a) { return _mm512_reduce_add_ps(a); }
  static void pin(In& v) { asm volatile("" : "+v"(v)); }
};
#endif

#if defined(__AVX2__) && defined(__FMA__)
struct Avx2F32 {
  using Acc = __m256;
  using In = __m256;
  static constexpr int64_t STEP = 8, MAX_R = 3;
  static Acc zero() { return _mm256_setzero_ps(); }
  static In load(const float* p) { return _mm256_loadu_ps(p); }
  static In tail(const float* p, int64_t n) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane));
  }
  static Acc dot(Acc a, In x, In w) { return _mm256_fmadd_ps(x, w, a); }
  static float sum(Acc a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static void pin(In& v) { asm volatile("" : "+x"(v)); }
};
#endif

// Plain loops (no AVX2): one column a step; the compiler vectorizes what it can.
struct Scalar {
  using Acc = float;
  using In = float;
  static constexpr int64_t STEP = 1, MAX_R = 3;
  static Acc zero() { return 0.f; }
  static In load(const float* p) { return *p; }
  static In tail(const float*, int64_t) { return 0.f; }
  static Acc dot(Acc a, In x, In w) { return a + x * w; }
  static float sum(Acc a) { return a; }
  static void pin(In&) {}
};

// One vector of columns at k: MT x R products added to acc (`TAIL`: the last n < STEP columns, masked).
template <class Isa, int MT, int R, bool TAIL>
inline __attribute__((always_inline)) void step(typename Isa::Acc (&acc)[MT][R], const float* x,
                                                int64_t ldx, const float* w, int64_t ldw, int64_t k,
                                                int64_t n) {
  typename Isa::In wv[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    wv[r] = TAIL ? Isa::tail(w + r * ldw + k, n) : Isa::load(w + r * ldw + k);
    Isa::pin(wv[r]);
  }
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m) {
    typename Isa::In xv = TAIL ? Isa::tail(x + m * ldx + k, n) : Isa::load(x + m * ldx + k);
    Isa::pin(xv);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) acc[m][r] = Isa::dot(acc[m][r], xv, wv[r]);
  }
}

// y[m, r] += dot(x[m, :kb], w[r, :kb]) for m < MT, r < R (y: the chunk's fp32 sums); `per_step` prefetches every
// PF_COLS columns.
template <class Isa, int MT, int R>
void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t kb, float* y,
          int64_t ldy, Prefetcher& pf, int64_t per_step) {
  typename Isa::Acc acc[MT][R];
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) acc[m][r] = Isa::zero();
  const int64_t kv = kb - kb % Isa::STEP;
  for (int64_t k0 = 0; k0 < kv; k0 += PF_COLS) {
    pf.issue(per_step);
    const int64_t kend = std::min(kv, k0 + PF_COLS);
#pragma GCC unroll 2
    for (int64_t k = k0; k < kend; k += Isa::STEP) step<Isa, MT, R, false>(acc, x, ldx, w, ldw, k, 0);
  }
  if (kv < kb) step<Isa, MT, R, true>(acc, x, ldx, w, ldw, kv, kb - kv);
  // every loop over acc unrolled in full: an array indexed by a variable would live in memory, not registers
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) y[m * ldy + r] += Isa::sum(acc[m][r]);
}

template <class Isa, int R>
void tile_rows(int64_t mt, const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t kb,
               float* y, int64_t ldy, Prefetcher& pf, int64_t per_step) {
  switch (mt) {
    case 4: return tile<Isa, 4, R>(x, ldx, w, ldw, kb, y, ldy, pf, per_step);
    case 3: return tile<Isa, 3, R>(x, ldx, w, ldw, kb, y, ldy, pf, per_step);
    case 2: return tile<Isa, 2, R>(x, ldx, w, ldw, kb, y, ldy, pf, per_step);
    default: return tile<Isa, 1, R>(x, ldx, w, ldw, kb, y, ldy, pf, per_step);
  }
}

template <class Isa>
void tile_any(int64_t r, int64_t mt, const float* x, int64_t ldx, const float* w, int64_t ldw,
              int64_t kb, float* y, int64_t ldy, Prefetcher& pf, int64_t per_step) {
  switch (r) {
    case 1: return tile_rows<Isa, 1>(mt, x, ldx, w, ldw, kb, y, ldy, pf, per_step);
    case 2: return tile_rows<Isa, 2>(mt, x, ldx, w, ldw, kb, y, ldy, pf, per_step);
    case 3: return tile_rows<Isa, 3>(mt, x, ldx, w, ldw, kb, y, ldy, pf, per_step);
  }
  if constexpr (Isa::MAX_R >= 6) {
    switch (r) {
      case 4: return tile_rows<Isa, 4>(mt, x, ldx, w, ldw, kb, y, ldy, pf, per_step);
      case 5: return tile_rows<Isa, 5>(mt, x, ldx, w, ldw, kb, y, ldy, pf, per_step);
      default: return tile_rows<Isa, 6>(mt, x, ldx, w, ldw, kb, y, ldy, pf, per_step);
    }
  }
}

template <class Isa>
void run(const at::Tensor& x, const at::Tensor& weight, const at::Tensor* bias, at::Tensor& y) {
  constexpr int64_t TILE_N = Isa::MAX_R;
  constexpr int64_t CHUNK_ROWS = 8 * TILE_N;  // weight rows a task's block holds
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const int64_t k_blocks = (K + MAX_BLOCK_K - 1) / MAX_BLOCK_K;
  // blocks a whole number of vectors wide, but the last
  const int64_t block_k = std::min(K, ((K + k_blocks - 1) / k_blocks + 31) & ~int64_t{31});
  const int64_t chunks = (N + CHUNK_ROWS - 1) / CHUNK_ROWS;
  const int64_t m_tiles = (M + TILE_M - 1) / TILE_M;

  at::parallel_for(0, chunks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> sums(M * CHUNK_ROWS);
    for (int64_t c = lo; c < hi; ++c) {
      const int64_t n0 = c * CHUNK_ROWS, n1 = std::min(N, n0 + CHUNK_ROWS), width = n1 - n0;
      std::fill(sums.begin(), sums.end(), 0.f);
      for (int64_t k0 = 0; k0 < K; k0 += block_k) {
        const int64_t kb = std::min(block_k, K - k0);
        // the next block this task computes: the chunk's next columns, else the next chunk's first ones
        Prefetcher pf;
        const int64_t next_k = k0 + kb < K ? k0 + kb : 0;
        const int64_t next_n0 = k0 + kb < K ? n0 : n1;
        if (next_k > 0 || c + 1 < hi) {
          pf.row = reinterpret_cast<const char*>(wp + next_n0 * K + next_k);
          pf.row_bytes = std::min(block_k, K - next_k) * static_cast<int64_t>(sizeof(float));
          pf.stride = K * static_cast<int64_t>(sizeof(float));
          pf.rows = std::min(N, next_n0 + CHUNK_ROWS) - next_n0;
        }
        // spread the lines over every tile call's PF_COLS-column steps
        const int64_t calls = m_tiles * ((width + TILE_N - 1) / TILE_N);
        const int64_t lines = pf.rows * ((pf.row_bytes + LINE - 1) / LINE);
        const int64_t steps = calls * std::max<int64_t>(1, (kb - kb % Isa::STEP + PF_COLS - 1) / PF_COLS);
        const int64_t per_step = (lines + steps - 1) / steps;
        for (int64_t m = 0; m < M; m += TILE_M) {
          const int64_t mt = std::min(TILE_M, M - m);
          for (int64_t n = n0; n < n1; n += TILE_N) {
            tile_any<Isa>(std::min(TILE_N, n1 - n), mt, xp + m * ldx + k0, ldx, wp + n * K + k0, K, kb,
                          sums.data() + m * CHUNK_ROWS + (n - n0), CHUNK_ROWS, pf, per_step);
          }
        }
      }
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = n0; n < n1; ++n)
          yp[m * N + n] = sums[m * CHUNK_ROWS + (n - n0)] + (bp ? bp[n] : 0.f);
    }
  });
}

at::Tensor skinny_linear(const at::Tensor& x_in, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.device().is_cpu() && weight.device().is_cpu(), "skinny_linear: CPU tensors only");
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kFloat && x_in.scalar_type() == dtype, "skinny_linear: x and weight must be float32, not ",
              x_in.scalar_type(), " and ", dtype);
  TORCH_CHECK(x_in.dim() == 2 && weight.dim() == 2, "skinny_linear: x [M, K] and weight [N, K] must be 2-D");
  TORCH_CHECK(x_in.size(1) == weight.size(1), "skinny_linear: x has ", x_in.size(1), " columns, weight ",
              weight.size(1));
  TORCH_CHECK(weight.is_contiguous(), "skinny_linear: weight must be contiguous");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous(),
                "skinny_linear: bias must be a contiguous ", dtype, " [", N, "]");
  }
  at::Tensor y = at::empty({M, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (M == 0 || N == 0) return y;
  if (K == 0) return bias.has_value() ? y.copy_(bias->expand({M, N})) : y.zero_();
  const at::Tensor* b = bias.has_value() ? &*bias : nullptr;
#if defined(__AVX512F__)
  run<Avx512F32>(x, weight, b, y);
#elif defined(__AVX2__) && defined(__FMA__)
  run<Avx2F32>(x, weight, b, y);
#else
  run<Scalar>(x, weight, b, y);
#endif
  return y;
}

// skinny_linear with a group's LoRA added: loragate_kernels/cpu/lora.cpp's op on its output (the same arguments), in
// one call where there were two (a decode step makes 120 of each, and a call costs several microseconds of dispatch
// between kernels that have just evicted the dispatcher from the caches).
at::Tensor skinny_linear_lora(const at::Tensor& x_in, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                              const at::Tensor& segments, const at::Tensor& pool, const at::Tensor& block,
                              at::IntArrayRef out_cols) {
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  at::Tensor y = skinny_linear(x, weight, bias);
  loragate_cpu::add_lora(y, x, segments, pool, block, out_cols);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate_cpu, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def(
      "skinny_linear_lora(Tensor x, Tensor weight, Tensor? bias, Tensor segments, Tensor pool, Tensor block, "
      "int[] out_cols) -> Tensor");
}

TORCH_LIBRARY_IMPL(loragate_cpu, CPU, m) {
  m.impl("skinny_linear", &skinny_linear);
  m.impl("skinny_linear_lora", &skinny_linear_lora);
}
