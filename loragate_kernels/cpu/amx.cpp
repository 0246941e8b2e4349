// The CPU path's bf16 GEMM over its own tile layout of the weight (loragate_kernels/cpu/build.py builds this file;
// loragate_kernels/backends.py decides where it runs; F.linear is its oracle in tests/kernels/test_cpu_amx.py):
//
//   amx_pack_weight(weight)           weight [N, K] bf16 -> the tile layout below (N and K multiples of 32)
//   amx_linear(x, packed, bias)       x [M, K] @ weight^T (+ bias [N]) -> new [M, N] bf16, sums in fp32: on AMX
//                                     tiles where the process can use them, else on the AVX-512 bf16 dot instruction
//   dot_linear(x, packed, bias)       the same on the bf16 dot instruction, AMX or not (tests run it everywhere)
//   amx_ready(), dot_ready()          whether this build has the AMX kernel and Linux lets the process use tiles;
//                                     whether it has the dot kernel
//
// A decode step multiplies tens of rows by every weight of the model once, so its GEMMs stream the weights from memory,
// and oneDNN's packed bf16 GEMMs read them well below the rate a plain sum reads. The AMX kernel reads each thread's
// share of a weight as one sequential stream (the layout below puts a block of 32 output columns, all of K, in one
// contiguous run, and a thread takes consecutive blocks), asks for the lines 8 KB ahead into L2 as it goes, and
// multiplies on the tile unit (two 16 x 32 tiles of x against two 32 x 16 tiles of the weight into four 16 x 16 fp32
// accumulators per 32 columns of K), close to a plain sum's rate at decode row counts. At hundreds of rows (prefill) it
// runs a little behind oneDNN's packed GEMMs, kept rather than a second copy of every weight (docs/performance.md,
// *GEMMs, route by route*, has the figures).
//
// Without AMX (an AVX-512 + avx512_bf16 EPYC), the dot kernel reads the same layout: a 64-byte row of it is one K
// pair for 16 output columns, which is what the bf16 dot instruction multiplies against a broadcast pair of x. A tile
// is 4 rows of x by 96 output columns (24 fp32 sums in registers, no horizontal sums). A thread takes consecutive runs
// of 96 columns and asks for its next run a few lines per K block while it computes the current one (its first run:
// 8 KB ahead of its first pass). At decode row counts it runs ahead of oneDNN's packed kernels (docs/performance.md).
//
// Layout: packed[N / 32][K / 32][2][16][32]: for block nb of 32 output columns and block kb of 32 columns of K,
// tile t (its columns 16 t .. 16 t + 15) holds in row r the pairs (k = 2r, 2r + 1) of each of its 16 columns, as
// the tile instruction reads its second operand: element [r][2 n + j] = weight[32 nb + 16 t + n][32 kb + 2 r + j].

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "lora.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define LORAGATE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t BLOCK_N = 32;  // output columns per block: two tiles of 16
constexpr int64_t BLOCK_K = 32;  // columns of K a tile step takes (16 rows of bf16 pairs)
constexpr int64_t TILE_ELEMS = 16 * 32;

#if defined(LORAGATE_AMX)
constexpr int64_t PREFETCH_BYTES = 8192;  // how far ahead of its reads a thread asks for its weight's lines

// Linux hands out the tile registers' state only to processes that ask (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); asked once.
bool tiles_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct alignas(64) TileConfig {  // palette 1: eight tiles of 16 rows x 64 bytes
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {0};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// Tiles: 0, 1 = x rows m0 .. m0 + 15 and m0 + 16 .. m0 + 31; 2, 3 = the weight's two column tiles; 4 .. 7 = the sums
// (x tile i, weight tile j) -> 4 + 2 i + j.
void multiply(const c10::BFloat16* a, int64_t a_stride, int64_t m_pad, int64_t m, const c10::BFloat16* packed,
              int64_t num_blocks, int64_t k_blocks, const c10::BFloat16* bias, c10::BFloat16* y, int64_t n) {
  const int64_t block_elems = k_blocks * 2 * TILE_ELEMS;
  at::parallel_for(0, num_blocks, 1, [&](int64_t lo, int64_t hi) {
    const TileConfig config;
    _tile_loadconfig(&config);
    alignas(64) float sums[32][32];
    const char* stream_end = reinterpret_cast<const char*>(packed + hi * block_elems);
    for (int64_t nb = lo; nb < hi; ++nb) {
      const c10::BFloat16* block = packed + nb * block_elems;
      for (int64_t m0 = 0; m0 < m_pad; m0 += 32) {
        const bool two = m0 + 16 < m_pad;
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t kb = 0; kb < k_blocks; ++kb) {
          const c10::BFloat16* w = block + kb * 2 * TILE_ELEMS;
          if (m0 == 0) {  // the first pass over the block reads it from memory: ask for what comes next
            const char* ahead = reinterpret_cast<const char*>(w) + PREFETCH_BYTES;
            if (ahead + 2 * TILE_ELEMS * 2 <= stream_end)
              for (int64_t line = 0; line < 2 * TILE_ELEMS * 2; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T1);
          }
          _tile_loadd(2, w, 64);
          _tile_loadd(3, w + TILE_ELEMS, 64);
          _tile_loadd(0, a + m0 * a_stride + kb * BLOCK_K, a_stride * 2);
          _tile_dpbf16ps(4, 0, 2);
          _tile_dpbf16ps(5, 0, 3);
          if (two) {
            _tile_loadd(1, a + (m0 + 16) * a_stride + kb * BLOCK_K, a_stride * 2);
            _tile_dpbf16ps(6, 1, 2);
            _tile_dpbf16ps(7, 1, 3);
          }
        }
        _tile_stored(4, &sums[0][0], 128);
        _tile_stored(5, &sums[0][16], 128);
        if (two) {
          _tile_stored(6, &sums[16][0], 128);
          _tile_stored(7, &sums[16][16], 128);
        }
        __m512 bias_lo = _mm512_setzero_ps(), bias_hi = _mm512_setzero_ps();
        if (bias != nullptr) {
          const auto widen = [](const c10::BFloat16* p) {  // 16 bf16 -> fp32: the bits, shifted
            const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
            return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
          };
          bias_lo = widen(bias + nb * BLOCK_N);
          bias_hi = widen(bias + nb * BLOCK_N + 16);
        }
        for (int64_t r = 0; r < std::min<int64_t>(32, m - m0); ++r) {  // rounded to bf16 once, as oneDNN does
          const __m512 lo16 = _mm512_add_ps(_mm512_load_ps(&sums[r][0]), bias_lo);
          const __m512 hi16 = _mm512_add_ps(_mm512_load_ps(&sums[r][16]), bias_hi);
          _mm512_storeu_si512(y + (m0 + r) * n + nb * BLOCK_N, (__m512i)_mm512_cvtne2ps_pbh(hi16, lo16));
        }
      }
    }
    _tile_release();
  });
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define LORAGATE_DOT_BF16 1
constexpr int64_t DOT_PREFETCH_KB = 4;  // how many K blocks (2 KB of a column block each) ahead a first pass asks for

using loragate_cpu::Ahead;  // the thread's next run of column blocks, asked for a few lines per K block

// Rows [0, MT) of x against NB consecutive column blocks (32 output columns each) of the tile layout, on the bf16 dot
// instruction: for each pair of K columns, a 64-byte row of the layout holds that pair for 16 output columns, and
// each x row's pair is broadcast against it (MT x 2 NB sums in registers; no horizontal sums). `first`: the thread's
// first pass over its first run, which nothing asked for: it asks for the lines DOT_PREFETCH_KB K blocks ahead.
template <int MT, int NB>
inline void dot_tile(const c10::BFloat16* a, int64_t a_stride, const c10::BFloat16* blocks, int64_t block_elems,
                     int64_t k_blocks, const c10::BFloat16* bias, c10::BFloat16* y, int64_t n, bool first,
                     const char* stream_end, Ahead& ahead) {
  __m512 acc[MT][2 * NB];
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 6
    for (int v = 0; v < 2 * NB; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    if (first)
#pragma GCC unroll 3
      for (int b = 0; b < NB; ++b) {
        const char* soon =
            reinterpret_cast<const char*>(blocks + b * block_elems + (kb + DOT_PREFETCH_KB) * 2 * TILE_ELEMS);
        if (soon + 2 * TILE_ELEMS * 2 <= stream_end)
          for (int64_t line = 0; line < 2 * TILE_ELEMS * 2; line += 64) _mm_prefetch(soon + line, _MM_HINT_T1);
      }
    ahead.issue();
    const c10::BFloat16* xk = a + kb * BLOCK_K;
#pragma GCC unroll 2
    for (int r = 0; r < 16; ++r) {
      __m512i wv[2 * NB];
#pragma GCC unroll 6
      for (int v = 0; v < 2 * NB; ++v) {
        wv[v] = _mm512_loadu_si512(blocks + (v / 2) * block_elems + ((kb * 2 + v % 2) * 16 + r) * 32);
        asm volatile("" : "+v"(wv[v]));
      }
#pragma GCC unroll 4
      for (int m = 0; m < MT; ++m) {
        int32_t pair;
        std::memcpy(&pair, xk + m * a_stride + 2 * r, sizeof pair);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 6
        for (int v = 0; v < 2 * NB; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], (__m512bh)wv[v], xb);
      }
    }
  }
#pragma GCC unroll 6
  for (int v = 0; v < 2 * NB; ++v) {  // rounded to bf16 once, as oneDNN does
    const __m512 b16 = bias != nullptr ? loragate_cpu::load16(bias + 16 * v) : _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int m = 0; m < MT; ++m) loragate_cpu::store16(y + m * n + 16 * v, _mm512_add_ps(acc[m][v], b16));
  }
}

template <int NB>
void dot_rows(int64_t mt, const c10::BFloat16* a, int64_t a_stride, const c10::BFloat16* blocks, int64_t block_elems,
              int64_t k_blocks, const c10::BFloat16* bias, c10::BFloat16* y, int64_t n, bool first, const char* end,
              Ahead& ahead) {
  switch (mt) {
    case 4: return dot_tile<4, NB>(a, a_stride, blocks, block_elems, k_blocks, bias, y, n, first, end, ahead);
    case 3: return dot_tile<3, NB>(a, a_stride, blocks, block_elems, k_blocks, bias, y, n, first, end, ahead);
    case 2: return dot_tile<2, NB>(a, a_stride, blocks, block_elems, k_blocks, bias, y, n, first, end, ahead);
    default: return dot_tile<1, NB>(a, a_stride, blocks, block_elems, k_blocks, bias, y, n, first, end, ahead);
  }
}

constexpr int64_t DOT_GROUP = 3;  // column blocks a tile takes: 96 output columns, 24 sums in registers at 4 rows

void dot_multiply(const c10::BFloat16* a, int64_t a_stride, int64_t m, const c10::BFloat16* packed, int64_t num_blocks,
                  int64_t k_blocks, const c10::BFloat16* bias, c10::BFloat16* y, int64_t n) {
  const int64_t block_elems = k_blocks * 2 * TILE_ELEMS;
  const int64_t groups = (num_blocks + DOT_GROUP - 1) / DOT_GROUP;
  at::parallel_for(0, groups, 1, [&](int64_t lo, int64_t hi) {
    const char* end = reinterpret_cast<const char*>(packed + std::min(num_blocks, hi * DOT_GROUP) * block_elems);
    const int64_t m_tiles = (m + 3) / 4;
    for (int64_t g = lo; g < hi; ++g) {
      const int64_t nb0 = g * DOT_GROUP, nbs = std::min(DOT_GROUP, num_blocks - nb0);
      const c10::BFloat16* blocks = packed + nb0 * block_elems;
      const c10::BFloat16* b = bias ? bias + nb0 * BLOCK_N : nullptr;
      // the thread's next run, asked for over this run's passes (its first run asks ahead in its own first pass)
      Ahead ahead;
      if (g + 1 < hi) {
        const char* next = reinterpret_cast<const char*>(blocks + nbs * block_elems);
        ahead = Ahead::over(next, std::min(end, next + DOT_GROUP * block_elems * 2) - next, m_tiles * k_blocks);
      }
      for (int64_t m0 = 0; m0 < m; m0 += 4) {
        const int64_t mt = std::min<int64_t>(4, m - m0);
        c10::BFloat16* yt = y + m0 * n + nb0 * BLOCK_N;
        const c10::BFloat16* at = a + m0 * a_stride;
        const bool first = m0 == 0 && g == lo;
        switch (nbs) {
          case 3: dot_rows<3>(mt, at, a_stride, blocks, block_elems, k_blocks, b, yt, n, first, end, ahead); break;
          case 2: dot_rows<2>(mt, at, a_stride, blocks, block_elems, k_blocks, b, yt, n, first, end, ahead); break;
          default: dot_rows<1>(mt, at, a_stride, blocks, block_elems, k_blocks, b, yt, n, first, end, ahead); break;
        }
      }
    }
  });
}
#endif

// Whether this build has the bf16 dot kernel (a CPU with AVX-512 bf16).
bool dot_ready() {
#if defined(LORAGATE_DOT_BF16)
  return true;
#else
  return false;
#endif
}

bool amx_ready() {
#if defined(LORAGATE_AMX)
  return tiles_permitted();
#else
  return false;
#endif
}

at::Tensor amx_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
              "weight must be a 2-D bf16 CPU tensor");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % BLOCK_N == 0 && k % BLOCK_K == 0, "weight's dims must be multiples of 32, not [", n, ", ", k, "]");
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty({n / BLOCK_N, k / BLOCK_K, 2, 16, 32}, weight.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  const int64_t k_blocks = k / BLOCK_K;
  at::parallel_for(0, n / BLOCK_N, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t nb = lo; nb < hi; ++nb)
      for (int64_t kb = 0; kb < k_blocks; ++kb)
        for (int64_t t = 0; t < 2; ++t)
          for (int64_t r = 0; r < 16; ++r) {
            uint16_t* row = dst + (((nb * k_blocks + kb) * 2 + t) * 16 + r) * 32;
            for (int64_t c = 0; c < 16; ++c)
              for (int64_t j = 0; j < 2; ++j)
                row[2 * c + j] = src[(nb * BLOCK_N + 16 * t + c) * k + kb * BLOCK_K + 2 * r + j];
          }
  });
  return out;
}

// The tile layout's GEMM on one kernel: AMX tiles (`tiles`) or the bf16 dot instruction. Checks every argument first.
at::Tensor tile_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       bool tiles) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu() && x.stride(1) == 1,
              "x must be a 2-D bf16 CPU tensor with contiguous columns");
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == 2 && packed.size(3) == 16 && packed.size(4) == 32,
              "packed must be amx_pack_weight's [N/32, K/32, 2, 16, 32]");
  const int64_t m = x.size(0), k = x.size(1), num_blocks = packed.size(0), k_blocks = packed.size(1);
  const int64_t n = num_blocks * BLOCK_N;
  TORCH_CHECK(k == k_blocks * BLOCK_K, "x has ", k, " columns, the weight ", k_blocks * BLOCK_K);
  const c10::BFloat16* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() &&
                    bias->scalar_type() == at::kBFloat16,
                "bias must be a contiguous bf16 [", n, "]");
    bias_ptr = bias->data_ptr<c10::BFloat16>();
  }
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  if (!tiles) {
#if defined(LORAGATE_DOT_BF16)
    dot_multiply(x.data_ptr<c10::BFloat16>(), x.stride(0), m, packed.data_ptr<c10::BFloat16>(), num_blocks, k_blocks,
                 bias_ptr, y.data_ptr<c10::BFloat16>(), n);
#endif
    return y;
  }
#if defined(LORAGATE_AMX)
  // The tiles read 16 rows at a time: a row count that is not a multiple of 16 gets a zero-padded copy of x.
  const int64_t m_pad = (m + 15) / 16 * 16;
  at::Tensor a = x;
  if (m_pad != m) {
    a = at::empty({m_pad, k}, x.options());
    a.narrow(0, 0, m).copy_(x);
    a.narrow(0, m, m_pad - m).zero_();
  }
  multiply(a.data_ptr<c10::BFloat16>(), a.stride(0), m_pad, m, packed.data_ptr<c10::BFloat16>(), num_blocks, k_blocks,
           bias_ptr, y.data_ptr<c10::BFloat16>(), n);
#endif
  return y;
}

// The layout's GEMM on AMX tiles where the process can use them, else on the bf16 dot instruction.
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_ready() || dot_ready(), "amx_linear: this build or process can use neither AMX tiles nor the "
              "AVX-512 bf16 dot instruction");
  return tile_linear(x, packed, bias, amx_ready());
}

// The layout's GEMM on the bf16 dot instruction, whether or not the CPU has AMX (tests run it on both kinds).
at::Tensor dot_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(dot_ready(), "dot_linear: this build has no AVX-512 bf16 dot instruction");
  return tile_linear(x, packed, bias, false);
}

// amx_linear with a group's LoRA added, in one call: as cpu/gemm.cpp's skinny_linear_lora.
at::Tensor amx_linear_lora(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                           const at::Tensor& segments, const at::Tensor& pool, const at::Tensor& block,
                           at::IntArrayRef out_cols) {
  at::Tensor y = amx_linear(x, packed, bias);
  loragate_cpu::add_lora(y, x, segments, pool, block, out_cols);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate_cpu, m) {
  m.def("amx_ready() -> bool", &amx_ready);  // no tensor arguments: one kernel for every dispatch key
  m.def("dot_ready() -> bool", &dot_ready);
  m.def("amx_pack_weight(Tensor weight) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("dot_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def(
      "amx_linear_lora(Tensor x, Tensor packed, Tensor? bias, Tensor segments, Tensor pool, Tensor block, "
      "int[] out_cols) -> Tensor");
}

TORCH_LIBRARY_IMPL(loragate_cpu, CPU, m) {
  m.impl("amx_pack_weight", &amx_pack_weight);
  m.impl("amx_linear", &amx_linear);
  m.impl("dot_linear", &dot_linear);
  m.impl("amx_linear_lora", &amx_linear_lora);
}
