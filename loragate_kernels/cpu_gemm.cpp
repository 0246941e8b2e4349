// The CPU path's GEMM for few rows against a weight that streams from memory (loragate_kernels/cpu_ops.py builds
// this file; engine/model/cpu_gemm.py decides where it runs; F.linear is its oracle in tests/kernels/test_cpu_gemm.py):
//
//   skinny_linear(x, weight, bias)   x [M, K] @ weight[N, K]^T (+ bias [N])   -> new [M, N], fp32
//
// A decode step multiplies tens of rows by every weight of the model once: each weight byte is used M times, and
// is read from DRAM (a model is far larger than the caches). oneDNN's AVX2 kernels keep the FMA units busy once
// the weight is in cache, but stall on its first read: on a 2-core AVX2 EPYC, W1's decode GEMMs (M = 32) ran at
// ~90 GFLOP/s streaming against ~150 cached. This op reads the weight in blocks of CHUNK_ROWS rows x at most
// MAX_BLOCK_K columns (in L2 with the block's rows of x), and while it computes one block it prefetches the next
// one into L2, a few lines per 64 columns of every tile, so the next block's reads are hits.
//
// A tile is the dot products of TILE_M rows of x with TILE_N rows of the weight, 8 columns at a time: 12 ymm
// accumulators, 3 weight vectors and 1 x vector fill AVX2's 16 registers, reduced horizontally once per block.
// The weight keeps its row-major layout (no reorder; the oneDNN route for larger row counts reads the same tensor).
// Sums run in fp32 in another order than a BLAS (last-bit differences). Without AVX2 and FMA the same blocking
// runs as plain loops the compiler vectorizes.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LORAGATE_GEMM_AVX2 1
#endif

namespace {

constexpr int64_t TILE_M = 4;
constexpr int64_t TILE_N = 3;  // tile<MT, R> handles R <= 3
constexpr int64_t CHUNK_ROWS = 8 * TILE_N;  // weight rows a task's block holds: 24 x 576 fp32 = 54 KB
constexpr int64_t MAX_BLOCK_K = 1024;       // columns per block: 24 rows x 1024 x 4 B = 96 KB of weight
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
#ifdef LORAGATE_GEMM_AVX2
      _mm_prefetch(row + offset, _MM_HINT_T1);
#else
      __builtin_prefetch(row + offset, 0, 2);
#endif
      offset += LINE;
      if (offset >= row_bytes) {
        offset = 0;
        row += stride;
        --rows;
      }
    }
  }
};

#ifdef LORAGATE_GEMM_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// y[m, r] (+)= dot(x[m, :kb], w[r, :kb]) for m < MT, r < R; `per_block` prefetches every 64 columns.
template <int MT, int R>
void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t kb, float* y, int64_t ldy, bool add,
          Prefetcher& pf, int64_t per_block) {
  float out[MT][R];
  const int64_t kv = kb & ~int64_t{7};
#ifdef LORAGATE_GEMM_AVX2
  __m256 acc[MT][R];
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 3
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < kv; k0 += 64) {
    pf.issue(per_block);
    const int64_t kend = std::min(kv, k0 + 64);
#pragma GCC unroll 2
    for (int64_t k = k0; k < kend; k += 8) {
      // each vector loaded once: the compiler would rather fold a load into every FMA that reads it (MT or R
      // times over), and L1's ports, not the FMA units, would set the pace
      __m256 w0 = _mm256_loadu_ps(w + k), w1 = w0, w2 = w0;
      if constexpr (R > 1) w1 = _mm256_loadu_ps(w + ldw + k);
      if constexpr (R > 2) w2 = _mm256_loadu_ps(w + 2 * ldw + k);
      asm volatile("" : "+x"(w0), "+x"(w1), "+x"(w2));
#pragma GCC unroll 4
      for (int m = 0; m < MT; ++m) {
        __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
        asm volatile("" : "+x"(xv));
        acc[m][0] = _mm256_fmadd_ps(xv, w0, acc[m][0]);
        if constexpr (R > 1) acc[m][1] = _mm256_fmadd_ps(xv, w1, acc[m][1]);
        if constexpr (R > 2) acc[m][2] = _mm256_fmadd_ps(xv, w2, acc[m][2]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) out[m][r] = hsum(acc[m][r]);
#else
  for (int64_t k0 = 0; k0 < kv; k0 += 64) pf.issue(per_block);
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) {
      float s = 0.f;
      const float* xm = x + m * ldx;
      const float* wr = w + r * ldw;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < kv; ++k) s += xm[k] * wr[k];
      out[m][r] = s;
    }
#endif
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) {
      float s = out[m][r];
      for (int64_t k = kv; k < kb; ++k) s += x[m * ldx + k] * w[r * ldw + k];
      float* dst = y + m * ldy + r;
      *dst = add ? *dst + s : s;
    }
}

template <int R>
void tile_rows(int64_t mt, const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t kb, float* y,
               int64_t ldy, bool add, Prefetcher& pf, int64_t per_block) {
  switch (mt) {
    case 4: return tile<4, R>(x, ldx, w, ldw, kb, y, ldy, add, pf, per_block);
    case 3: return tile<3, R>(x, ldx, w, ldw, kb, y, ldy, add, pf, per_block);
    case 2: return tile<2, R>(x, ldx, w, ldw, kb, y, ldy, add, pf, per_block);
    default: return tile<1, R>(x, ldx, w, ldw, kb, y, ldy, add, pf, per_block);
  }
}

at::Tensor skinny_linear(const at::Tensor& x_in, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.device().is_cpu() && weight.device().is_cpu(), "skinny_linear: CPU tensors only");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "skinny_linear: x and weight must be float32");
  TORCH_CHECK(x_in.dim() == 2 && weight.dim() == 2, "skinny_linear: x [M, K] and weight [N, K] must be 2-D");
  TORCH_CHECK(x_in.size(1) == weight.size(1), "skinny_linear: x has ", x_in.size(1), " columns, weight ",
              weight.size(1));
  TORCH_CHECK(weight.is_contiguous(), "skinny_linear: weight must be contiguous");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous(),
                "skinny_linear: bias must be a contiguous float32 [", N, "]");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (M == 0 || N == 0) return y;
  if (K == 0) return b ? y.copy_(bias->expand({M, N})) : y.zero_();

  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const int64_t k_blocks = (K + MAX_BLOCK_K - 1) / MAX_BLOCK_K;
  const int64_t block_k = std::min(K, ((K + k_blocks - 1) / k_blocks + 7) & ~int64_t{7});
  const int64_t chunks = (N + CHUNK_ROWS - 1) / CHUNK_ROWS;
  const int64_t m_tiles = (M + TILE_M - 1) / TILE_M;

  at::parallel_for(0, chunks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c) {
      const int64_t n0 = c * CHUNK_ROWS, n1 = std::min(N, n0 + CHUNK_ROWS);
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
        // spread the lines over every tile call's 64-column steps
        const int64_t calls = m_tiles * ((n1 - n0 + TILE_N - 1) / TILE_N);
        const int64_t lines = pf.rows * ((pf.row_bytes + LINE - 1) / LINE);
        const int64_t steps = calls * std::max<int64_t>(1, (kb / 8 * 8 + 63) / 64);
        const int64_t per_block = (lines + steps - 1) / steps;
        const bool add = k0 > 0;
        for (int64_t m = 0; m < M; m += TILE_M) {
          const int64_t mt = std::min(TILE_M, M - m);
          for (int64_t n = n0; n < n1; n += TILE_N) {
            const float* xs = xp + m * ldx + k0;
            const float* ws = wp + n * K + k0;
            float* ys = yp + m * N + n;
            switch (std::min(TILE_N, n1 - n)) {
              case 3: tile_rows<3>(mt, xs, ldx, ws, K, kb, ys, N, add, pf, per_block); break;
              case 2: tile_rows<2>(mt, xs, ldx, ws, K, kb, ys, N, add, pf, per_block); break;
              default: tile_rows<1>(mt, xs, ldx, ws, K, kb, ys, N, add, pf, per_block); break;
            }
          }
        }
      }
      if (b != nullptr)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = n0; n < n1; ++n) yp[m * N + n] += b[n];
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate_cpu, m) { m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(loragate_cpu, CPU, m) { m.impl("skinny_linear", &skinny_linear); }
