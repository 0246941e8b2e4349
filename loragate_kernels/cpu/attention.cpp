// The CPU path's paged decode attention: one new token per sequence attending over its context in one layer's
// paged KV cache, reading K and V through the block tables where they lie (no gather of the context into a
// batch-shaped copy, as the torch path does; loragate_kernels/cpu/ops.py documents the op,
// loragate_kernels/triton/paged_attention.py is the GPU's Triton twin and states the same semantics).
//
// One work item per sequence serves all its heads: each K/V row is read once per step, for the `group = num_heads /
// num_kv_heads` query heads that share its kv head (GQA), and a page is read front to back. Scores, the softmax and
// the output accumulate in fp32; probabilities are rounded to the cache's dtype before the product with V, as the
// torch path and the Triton kernel do. Positions at or past a sequence's context length are never read (the tail of
// its last block and the pages its table's padding names may hold another request's NaN/inf); a row with context
// length 0 gets zeros.
//
// A sliding window (`window` > 0, Hugging Face's rule: the query at position n - 1 sees keys p with
// n - 1 - window < p) limits a row with context n to positions [max(0, n - window), n): pages wholly before that are
// never read, so a windowed layer reads at most `window` keys a row whatever the context. Inside the loops "no window"
// is a span longer than any context (`kNoWindow`), so every path computes its first position the same way.
//
// In fp32, a prompt's rows (consecutive tokens of one sequence, engine/model/attention.py `_paged_rows`) go in blocks
// of up to 16, one row a lane (`prompt_block`): a block computes the scores of its rows against keys up to its last
// row's context, masks each row's later ones to -inf before the softmax, and never multiplies them into a row's output.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "common.h"


namespace {

using loragate_cpu::exp_nonpositive;
using loragate_cpu::round_to;
using loragate_cpu::store;
using loragate_cpu::to_f;

constexpr int64_t kNoWindow = std::numeric_limits<int64_t>::max() / 4;  // a span past any context, with room to add

// The first position a row with context n attends (`span`: its window, or kNoWindow).
inline int64_t window_start(int64_t n, int64_t span) { return std::max<int64_t>(0, n - span); }

// s[0, n) <- the softmax of s (whose maximum is top), each probability rounded to the cache's dtype T.
template <typename T>
inline void softmax_row(float* s, int64_t n, float top) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t p = 0; p < n; ++p) {
    s[p] = exp_nonpositive(s[p] - top);
    sum += s[p];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t p = 0; p < n; ++p) s[p] = round_to<T>(s[p] * inv);
}

template <typename T>
void decode_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& cache, const int64_t* tables,
                 int64_t table_stride, const int64_t* lens, double scale, int64_t span) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = cache.size(2), num_kv_heads = cache.size(3), group = num_heads / num_kv_heads;
  const int64_t s_page = cache.stride(0), s_kv = cache.stride(1), s_tok = cache.stride(2), s_head = cache.stride(3);
  const int64_t q_d = q.stride(0), q_h = q.stride(1), o_d = out.stride(0), o_h = out.stride(1);
  const T* qp = q.data_ptr<T>();
  const T* cp = cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);

  // One work item per sequence, all its kv heads: a page's keys (then values) for every head of a position are
  // one contiguous run, so each page is read front to back (what the hardware prefetcher follows).
  at::parallel_for(0, num_seqs, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> qf(num_heads * head_dim), acc(num_heads * head_dim), scores;
    for (int64_t d = lo; d < hi; ++d) {
      const int64_t n = lens[d];
      if (n <= 0) {
        for (int64_t h = 0; h < num_heads; ++h) std::fill_n(op + d * o_d + h * o_h, head_dim, static_cast<T>(0.f));
        continue;
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        const T* src = qp + d * q_d + h * q_h;
        for (int64_t e = 0; e < head_dim; ++e) qf[h * head_dim + e] = to_f(src[e]) * fscale;
      }
      const int64_t first = window_start(n, span), m = n - first;  // positions [first, n), score p - first each
      scores.resize(num_heads * m);
      const int64_t* table = tables + d * table_stride;
      // page by page from the window's first (no division per position)
      for (int64_t p0 = first / block_size * block_size; p0 < n; p0 += block_size) {
        const T* page = cp + table[p0 / block_size] * s_page;
        const int64_t count = std::min(block_size, n - p0);
        for (int64_t o = std::max<int64_t>(0, first - p0); o < count; ++o) {
          for (int64_t g = 0; g < num_kv_heads; ++g) {
            const T* k = page + o * s_tok + g * s_head;
            for (int64_t h = g * group; h < (g + 1) * group; ++h) {
              const float* qh = qf.data() + h * head_dim;
              float s = 0.f;
#pragma omp simd reduction(+ : s)
              for (int64_t e = 0; e < head_dim; ++e) s += qh[e] * to_f(k[e]);
              scores[h * m + p0 + o - first] = s;
            }
          }
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        float* s = scores.data() + h * m;
        float top = s[0];
#pragma omp simd reduction(max : top)
        for (int64_t p = 0; p < m; ++p) top = std::max(top, s[p]);
        softmax_row<T>(s, m, top);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p0 = first / block_size * block_size; p0 < n; p0 += block_size) {
        const T* page = cp + table[p0 / block_size] * s_page + s_kv;
        const int64_t count = std::min(block_size, n - p0);
        for (int64_t o = std::max<int64_t>(0, first - p0); o < count; ++o) {
          for (int64_t g = 0; g < num_kv_heads; ++g) {
            const T* v = page + o * s_tok + g * s_head;
            for (int64_t h = g * group; h < (g + 1) * group; ++h) {
              const float w = scores[h * m + p0 + o - first];
              float* a = acc.data() + h * head_dim;
#pragma omp simd
              for (int64_t e = 0; e < head_dim; ++e) a[e] += w * to_f(v[e]);
            }
          }
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        T* dst = op + d * o_d + h * o_h;
        for (int64_t e = 0; e < head_dim; ++e) dst[e] = static_cast<T>(acc[h * head_dim + e]);
      }
    }
  });
}

#if defined(__AVX512F__)
// The same computation with AVX-512 intrinsics for head dims of 32, 64 and 128 (NC = head_dim / 16 vectors of 16
// floats): a query head meets the keys of a page 16 positions at a time (16 dot products summed into one register of
// scores, `transpose_sum16`), and its output sums stay in registers across a page's values. K and V rows are
// converted to fp32 as they are loaded, except in bf16 on CPUs with the bf16 dot instruction, which multiplies them
// as they are (`scores16`, `values_page_bf16`).
using loragate_cpu::load16;
using loragate_cpu::transpose_sum16;

constexpr int64_t AHEAD = 2;  // pages between the one `decode_avx512` reads and the one it asks for

// The scores of m <= 16 positions (key rows `s_tok` apart from k) against one query head, one to a lane (lanes
// past m hold 0). bf16 on CPUs with the bf16 dot instruction: the raw bf16 query (`qb`, 32 to a register) against
// the keys, pairs multiplied exactly and summed in fp32, then scaled; otherwise the query in fp32, pre-scaled (`qv`).
// Whether T's products run on the bf16 dot instruction (bf16 on CPUs that have it).
template <typename T>
constexpr bool kBf16Dots =
#if defined(__AVX512BF16__)
    std::is_same_v<T, c10::BFloat16>;
#else
    false;
#endif

template <typename T, int NC>
inline __m512 scores16(const __m512* qv, const __m512i* qb, __m512 scale, const T* k, int64_t s_tok, int64_t m) {
  __m512 acc[16];
#if defined(__AVX512BF16__)
  if constexpr (kBf16Dots<T>) {
    for (int o = 0; o < 16; ++o) {
      acc[o] = _mm512_setzero_ps();
      if (o < m)
        for (int c = 0; c < NC / 2; ++c)
          acc[o] = _mm512_dpbf16_ps(acc[o], (__m512bh)qb[c], (__m512bh)_mm512_loadu_si512(k + o * s_tok + 32 * c));
    }
    return _mm512_mul_ps(transpose_sum16(acc), scale);
  }
#endif
  for (int o = 0; o < 16; ++o) {
    acc[o] = _mm512_setzero_ps();
    if (o < m)
      for (int c = 0; c < NC; ++c) acc[o] = _mm512_fmadd_ps(qv[c], load16(k + o * s_tok + 16 * c), acc[o]);
  }
  return transpose_sum16(acc);
}

#if defined(__AVX512BF16__)
// sums (2 NC registers of 16 floats) += s[o] v_o over positions o < count of a page: bf16 values (rows `s_tok` apart
// from v) and bf16-exact probabilities s, two positions a bf16 dot instruction, their rows interleaved element by
// element (so each pair is (v_o[e], v_o+1[e]) against (s[o], s[o+1])), sums in fp32. The interleave works within
// 128-bit chunks: the first NC / 2 registers gather elements 8k .. 8k+3 of each 32, the others 8k+4 .. 8k+7;
// `values_row_bf16` puts them back in order once every page is summed.
template <int NC>
inline void values_page_bf16(const float* s, int64_t count, const c10::BFloat16* v, int64_t s_tok, float* sums) {
  constexpr int NB = NC / 2;  // registers of 32 bf16 a row
  __m512 lo[NB], hi[NB];
  for (int c = 0; c < NB; ++c) {
    lo[c] = _mm512_loadu_ps(sums + 16 * c);
    hi[c] = _mm512_loadu_ps(sums + 16 * (NB + c));
  }
  const auto bits = [](float f) {  // the bf16 that f (already rounded to one) is
    uint32_t b;
    std::memcpy(&b, &f, sizeof b);
    return b >> 16;
  };
  for (int64_t o = 0; o < count; o += 2) {
    const bool pair = o + 1 < count;
    const __m512bh w =
        (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(bits(s[o]) | (pair ? bits(s[o + 1]) << 16 : 0u)));
    for (int c = 0; c < NB; ++c) {
      const __m512i a = _mm512_loadu_si512(v + o * s_tok + 32 * c);
      const __m512i b = pair ? _mm512_loadu_si512(v + (o + 1) * s_tok + 32 * c) : _mm512_setzero_si512();
      lo[c] = _mm512_dpbf16_ps(lo[c], (__m512bh)_mm512_unpacklo_epi16(a, b), w);
      hi[c] = _mm512_dpbf16_ps(hi[c], (__m512bh)_mm512_unpackhi_epi16(a, b), w);
    }
  }
  for (int c = 0; c < NB; ++c) {
    _mm512_storeu_ps(sums + 16 * c, lo[c]);
    _mm512_storeu_ps(sums + 16 * (NB + c), hi[c]);
  }
}

// row[0, 16 NC) from values_page_bf16's sums: lane 4k + j of a low register is element 8k + j, of a high one element
// 8k + 4 + j (k < 4, j < 4) of each 32.
template <int NC>
inline void values_row_bf16(const float* sums, float* row) {
  constexpr int NB = NC / 2;
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int c = 0; c < NB; ++c) {
    const __m512 lo = _mm512_loadu_ps(sums + 16 * c), hi = _mm512_loadu_ps(sums + 16 * (NB + c));
    _mm512_storeu_ps(row + 32 * c, _mm512_permutex2var_ps(lo, first, hi));
    _mm512_storeu_ps(row + 32 * c + 16, _mm512_permutex2var_ps(lo, second, hi));
  }
}
#endif

// Page by page: each page's keys, then its values, are read once, front to back, for every head, while a page AHEAD
// of it is asked for into L2 (pages lie anywhere in the cache, so the hardware prefetcher loses the stream at each).
// The queries and each head's output sums wait in small buffers in L1 between pages. Reading one head at a time over
// the whole context instead reads each page in one strided sweep per kv head, and takes about twice as long; so
// does this loop without the L2 requests. With them it still runs short of a plain read of the same bytes
// (docs/performance.md, *Attention*, has the figures).
template <typename T, int NC>
void decode_avx512(at::Tensor& out, const at::Tensor& q, const at::Tensor& cache, const int64_t* tables,
                   int64_t table_stride, const int64_t* lens, double scale, int64_t span,
                   const std::vector<int64_t>* only) {
  constexpr int64_t head_dim = NC * 16;
  const int64_t num_seqs = q.size(0), num_heads = q.size(1);
  const int64_t block_size = cache.size(2), num_kv_heads = cache.size(3), group = num_heads / num_kv_heads;
  const int64_t s_page = cache.stride(0), s_kv = cache.stride(1), s_tok = cache.stride(2), s_head = cache.stride(3);
  const int64_t q_d = q.stride(0), q_h = q.stride(1), o_d = out.stride(0), o_h = out.stride(1);
  const T* qp = q.data_ptr<T>();
  const T* cp = cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const __m512 vscale = _mm512_set1_ps(static_cast<float>(scale));
  const int64_t part_bytes = (block_size - 1) * s_tok * static_cast<int64_t>(sizeof(T)) +
                             num_kv_heads * s_head * static_cast<int64_t>(sizeof(T));  // a page's K (or V)

  const int64_t count = only ? static_cast<int64_t>(only->size()) : num_seqs;
  at::parallel_for(0, count, 1, [&](int64_t lo, int64_t hi) {
    // qf: the queries in fp32, scaled (or, for the bf16 dot instruction, as they are); acc: each head's output sums
    std::vector<float> scores, qf(num_heads * head_dim), acc(num_heads * head_dim), top(num_heads);
    alignas(64) float row[head_dim];
    int64_t last_first_page = -1;  // the first page of the last row's sequence
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t d = only ? (*only)[i] : i, n = lens[d];
      if (n <= 0) {
        for (int64_t h = 0; h < num_heads; ++h) std::fill_n(op + d * o_d + h * o_h, head_dim, static_cast<T>(0.f));
        continue;
      }
      // positions [first, n), position p's scores at p - first; the pages read are table[0, pages) from the one
      // holding `first`, whose slots before `skip` are not
      const int64_t first = window_start(n, span), width = n - first, skip = first % block_size;
      scores.resize(num_heads * width);
      const int64_t* table = tables + d * table_stride + first / block_size;
      const int64_t pages = (skip + width + block_size - 1) / block_size, end = skip + width;  // end: n, page-relative
      // ask(i, kv, steps): page i's K (kv = 0) or V (1) is asked for into L2 over the next `steps` calls of drip(),
      // a share each (one a head while a page AHEAD before it is used). Not where the row before began on the same
      // page (a prompt's rows attending here, engine/model/attention.py `_paged_rows`, or a shared prefix): its pages
      // are in cache already, and asking for them again cost a prompt step's attention 12%.
      const int64_t first_page = tables[d * table_stride];
      const bool cached = first_page == last_first_page;
      last_first_page = first_page;
      const char* next = nullptr;
      int64_t left = 0, per_step = 0;
      const auto ask = [&](int64_t i, int64_t kv, int64_t steps) {
        next = reinterpret_cast<const char*>(cp + table[i] * s_page + kv * s_kv);
        left = cached ? 0 : part_bytes;
        per_step = (part_bytes / 64 + steps) / steps;
      };
      const auto drip = [&] {
        for (int64_t i = 0; i < per_step && left > 0; ++i, next += 64, left -= 64) _mm_prefetch(next, _MM_HINT_T1);
      };
      for (int64_t h = 0; h < num_heads; ++h) {
        const T* src = qp + d * q_d + h * q_h;
        if constexpr (kBf16Dots<T>)
          std::memcpy(&qf[h * head_dim], src, head_dim * sizeof(T));
        else
          for (int c = 0; c < NC; ++c)
            _mm512_storeu_ps(&qf[h * head_dim + 16 * c], _mm512_mul_ps(load16(src + 16 * c), vscale));
      }
      std::fill(top.begin(), top.end(), -INFINITY);
      for (int64_t i = 0; i < AHEAD && i < pages; ++i) {  // the first pages' K, at once
        ask(i, 0, 1);
        drip();
      }
      for (int64_t i = 0; i < pages; ++i) {
        const int64_t p0 = i * block_size, count = std::min(block_size, end - p0), from = i == 0 ? skip : 0;
        if (const int64_t t = i + AHEAD; t < pages)  // a later page's K, or near the end the first pages' V
          ask(t, 0, num_heads);
        else if (t - pages < pages)
          ask(t - pages, 1, num_heads);
        else
          left = 0;
        for (int64_t h = 0; h < num_heads; ++h) {
          drip();
          __m512 qv[NC];
          __m512i qb[NC / 2];
          if constexpr (kBf16Dots<T>)
            for (int c = 0; c < NC / 2; ++c) qb[c] = _mm512_loadu_si512(&qf[h * head_dim] + 16 * c);
          else
            for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_ps(&qf[h * head_dim + 16 * c]);
          const T* k = cp + table[i] * s_page + (h / group) * s_head;
          __m512 tops = _mm512_set1_ps(top[h]);
          for (int64_t o = from; o < count; o += 16) {
            const int64_t m = std::min<int64_t>(16, count - o);
            const __mmask16 live = static_cast<__mmask16>((1u << m) - 1);
            const __m512 v = scores16<T, NC>(qv, qb, vscale, k + o * s_tok, s_tok, m);
            _mm512_mask_storeu_ps(&scores[h * width + p0 + o - skip], live, v);
            tops = _mm512_mask_max_ps(tops, live, tops, v);
          }
          top[h] = _mm512_reduce_max_ps(tops);
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) softmax_row<T>(&scores[h * width], width, top[h]);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = 0; i < pages; ++i) {
        const int64_t p0 = i * block_size, from = i == 0 ? skip : 0, count = std::min(block_size, end - p0) - from;
        if (i + AHEAD < pages)
          ask(i + AHEAD, 1, num_heads);
        else
          left = 0;
        for (int64_t h = 0; h < num_heads; ++h) {
          drip();
          float* a = &acc[h * head_dim];
          const T* v = cp + table[i] * s_page + s_kv + (h / group) * s_head + from * s_tok;  // `count` slots from here
          const float* w = &scores[h * width + p0 + from - skip];
#if defined(__AVX512BF16__)
          if constexpr (kBf16Dots<T>) {
            values_page_bf16<NC>(w, count, v, s_tok, a);
            continue;
          }
#endif
          __m512 sum[NC];
          for (int c = 0; c < NC; ++c) sum[c] = _mm512_loadu_ps(a + 16 * c);
          for (int64_t o = 0; o < count; ++o, v += s_tok) {
            const __m512 wv = _mm512_set1_ps(w[o]);
            for (int c = 0; c < NC; ++c) sum[c] = _mm512_fmadd_ps(wv, load16(v + 16 * c), sum[c]);
          }
          for (int c = 0; c < NC; ++c) _mm512_storeu_ps(a + 16 * c, sum[c]);
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        const float* sums = &acc[h * head_dim];
#if defined(__AVX512BF16__)
        if constexpr (kBf16Dots<T>) {
          values_row_bf16<NC>(sums, row);
          sums = row;
        }
#endif
        T* dst = op + d * o_d + h * o_h;
        for (int64_t e = 0; e < head_dim; e += 16) loragate_cpu::store16(dst + e, _mm512_loadu_ps(sums + e));
      }
    }
  });
}

// A prompt's rows as one block: rows d0 .. d0 + R - 1 (R <= 16) are consecutive tokens of one sequence, row r's context
// n0 + r over the same pages (engine/model/attention.py `_paged_rows`). `decode_avx512` reads a row's keys one row at a
// time and sums each score across lanes; here the block's rows are the lanes. Per query head: q^T [head_dim][16] once,
// then each key's 16 scores are head_dim FMAs of the key's elements, broadcast, against q^T's columns (no sums across
// lanes); the causal mask (and the window's, which keeps row r to keys from n0 + r - span), max, exp and sum run down
// the lanes; and each key's value row is read once per 4 rows. The block reads keys [lo, n): from row 0's window to the
// last row's context. Fp32 only (bf16 keeps the bf16 dot instruction's row loop).
constexpr int64_t BLOCK_ROWS = 16;     // rows a block holds, one a lane
constexpr int64_t MIN_BLOCK_ROWS = 4;  // fewer consecutive rows than this go through decode_avx512
constexpr int KEYS = 16;               // keys whose scores a pass of the scores loop sums in registers

template <int NC>
void prompt_block(float* op, int64_t o_d, int64_t o_h, const float* qp, int64_t q_d, int64_t q_h, const float* cp,
                  const int64_t* offsets, int64_t s_kv, int64_t s_head, int64_t group, int64_t num_heads, int64_t n0,
                  int64_t rows, int64_t span, float scale, std::vector<float>& scores) {
  constexpr int64_t head_dim = NC * 16;
  // keys [lo, n): row 0's first to the last row's context; key j's row is offsets[j - lo], its scores row j - lo
  const int64_t n = n0 + rows - 1, lo = window_start(n0, span);
  scores.resize((n - lo) * BLOCK_ROWS);
  const __mmask16 live_rows = static_cast<__mmask16>((1u << rows) - 1);
  alignas(64) float qt[head_dim * BLOCK_ROWS];
  for (int64_t h = 0; h < num_heads; ++h) {
    const float* keys = cp + (h / group) * s_head;
    for (int64_t r = 0; r < BLOCK_ROWS; ++r)
      for (int64_t e = 0; e < head_dim; ++e)
        qt[e * BLOCK_ROWS + r] = r < rows ? qp[r * q_d + h * q_h + e] * scale : 0.f;
    // the lanes key j reaches: rows r with n0 + r - span <= j < n0 + r (every key in [lo, n) reaches one at least)
    const auto live = [&](int64_t j) {
      const int64_t first = std::max<int64_t>(0, j - n0 + 1), past = std::min<int64_t>(BLOCK_ROWS, j - n0 + 1 + span);
      return static_cast<__mmask16>(live_rows & ((1u << past) - 1) & ~((1u << first) - 1));
    };
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t j0 = lo; j0 < n; j0 += KEYS) {
      const int64_t m = std::min<int64_t>(KEYS, n - j0);
      const float* k[KEYS];
      for (int64_t o = 0; o < KEYS; ++o) k[o] = keys + offsets[j0 - lo + std::min(o, m - 1)];
      __m512 acc[KEYS];
      for (int o = 0; o < KEYS; ++o) acc[o] = _mm512_setzero_ps();
      for (int64_t e = 0; e < head_dim; ++e) {
        const __m512 qv = _mm512_load_ps(qt + e * BLOCK_ROWS);
        for (int o = 0; o < KEYS; ++o) acc[o] = _mm512_fmadd_ps(_mm512_set1_ps(k[o][e]), qv, acc[o]);
      }
      for (int64_t o = 0; o < m; ++o) {
        const __m512 v = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live(j0 + o), acc[o]);
        _mm512_storeu_ps(&scores[(j0 - lo + o) * BLOCK_ROWS], v);
        top = _mm512_max_ps(top, v);
      }
    }
    // unnormalised probabilities; each row's output is divided by its sum as it is stored
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = lo; j < n; ++j) {
      float* s = &scores[(j - lo) * BLOCK_ROWS];
      const __m512 e = loragate_cpu::exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(s), top));
      const __m512 p = _mm512_maskz_mov_ps(live(j), e);
      _mm512_storeu_ps(s, p);
      sum = _mm512_add_ps(sum, p);
    }
    alignas(64) float inv[BLOCK_ROWS];
    _mm512_store_ps(inv, _mm512_maskz_div_ps(live_rows, _mm512_set1_ps(1.f), sum));
    const float* values = keys + s_kv;
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      __m512 acc[4][NC];
      for (int rr = 0; rr < 4; ++rr)
        for (int c = 0; c < NC; ++c) acc[rr][c] = _mm512_setzero_ps();
      // row r0 + rr reads keys [n0 + r0 + rr - span, n0 + r0 + rr): keys [n0 + r0 + 3 - span, n0 + r0) reach all 4
      // rows; the others only some, so no row multiplies a value outside its window or past its own context
      const int64_t begin = std::max(lo, n0 + r0 - span), last = std::min(n, n0 + r0 + 3);
      const int64_t all_from = n0 + r0 + 3 - span, all_to = std::min(n, n0 + r0);
      for (int64_t j = begin; j < last; ++j) {
        const float* v = values + offsets[j - lo];
        const float* w = &scores[(j - lo) * BLOCK_ROWS + r0];
        const bool all = j >= all_from && j < all_to;
        __m512 vv[NC];
        for (int c = 0; c < NC; ++c) vv[c] = _mm512_loadu_ps(v + 16 * c);
        for (int rr = 0; rr < 4; ++rr) {
          if (!all && (j >= n0 + r0 + rr || j < n0 + r0 + rr - span)) continue;
          const __m512 wv = _mm512_set1_ps(w[rr]);
          for (int c = 0; c < NC; ++c) acc[rr][c] = _mm512_fmadd_ps(wv, vv[c], acc[rr][c]);
        }
      }
      for (int64_t rr = 0; rr < 4 && r0 + rr < rows; ++rr) {
        const __m512 norm = _mm512_set1_ps(inv[r0 + rr]);
        for (int c = 0; c < NC; ++c)
          _mm512_storeu_ps(op + (r0 + rr) * o_d + h * o_h + 16 * c, _mm512_mul_ps(acc[rr][c], norm));
      }
    }
  }
}

// Splits the rows into prompt blocks (runs of >= MIN_BLOCK_ROWS consecutive tokens of one sequence, at most
// BLOCK_ROWS a block) and single rows; the blocks go through `prompt_block`, the rest through `decode_avx512`.
template <int NC>
void attend_f32(at::Tensor& out, const at::Tensor& q, const at::Tensor& cache, const int64_t* tables,
                int64_t table_stride, const int64_t* lens, double scale, int64_t span) {
  const int64_t num_seqs = q.size(0), block_size = cache.size(2);
  // rows a and b name the same pages for keys [from, len) (the pages a block reads: from row a's window on)
  const auto same_pages = [&](int64_t a, int64_t b, int64_t from, int64_t len) {
    const int64_t p = from / block_size, end = (len + block_size - 1) / block_size;
    return std::equal(tables + a * table_stride + p, tables + a * table_stride + end, tables + b * table_stride + p);
  };
  std::vector<int64_t> singles;
  std::vector<std::pair<int64_t, int64_t>> blocks;  // (first row, rows)
  for (int64_t d = 0; d < num_seqs;) {
    int64_t r = 1;
    while (r < BLOCK_ROWS && d + r < num_seqs && lens[d] > 0 && lens[d + r] == lens[d] + r &&
           same_pages(d, d + r, window_start(lens[d], span), lens[d + r]))
      ++r;
    if (r >= MIN_BLOCK_ROWS)
      blocks.emplace_back(d, r);
    else
      for (int64_t i = d; i < d + r; ++i) singles.push_back(i);
    d += r;
  }
  if (blocks.empty()) return decode_avx512<float, NC>(out, q, cache, tables, table_stride, lens, scale, span, nullptr);
  if (!singles.empty()) decode_avx512<float, NC>(out, q, cache, tables, table_stride, lens, scale, span, &singles);
  const int64_t num_heads = q.size(1), group = num_heads / cache.size(3);
  const int64_t s_page = cache.stride(0), s_tok = cache.stride(2);
  const float* qp = q.data_ptr<float>();
  const float* cp = cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> scores;
    std::vector<int64_t> offsets;  // key j's row: offsets[j - first] elements into the cache
    for (int64_t b = lo; b < hi; ++b) {
      const auto [d0, rows] = blocks[b];
      const int64_t n = lens[d0] + rows - 1, first = window_start(lens[d0], span);
      offsets.resize(n - first);
      const int64_t* table = tables + d0 * table_stride;
      for (int64_t j = first; j < n; ++j)
        offsets[j - first] = table[j / block_size] * s_page + (j % block_size) * s_tok;
      prompt_block<NC>(op + d0 * out.stride(0), out.stride(0), out.stride(1), qp + d0 * q.stride(0), q.stride(0),
                       q.stride(1), cp, offsets.data(), cache.stride(1), cache.stride(3), group, num_heads, lens[d0],
                       rows, span, static_cast<float>(scale), scores);
    }
  });
}

// fp32: prompt blocks and single rows (`attend_f32`); other dtypes: every row through `decode_avx512`.
template <typename T, int NC>
void attend_avx512(at::Tensor& out, const at::Tensor& q, const at::Tensor& cache, const int64_t* tables,
                   int64_t table_stride, const int64_t* lens, double scale, int64_t span) {
  if constexpr (std::is_same_v<T, float>)
    attend_f32<NC>(out, q, cache, tables, table_stride, lens, scale, span);
  else
    decode_avx512<T, NC>(out, q, cache, tables, table_stride, lens, scale, span, nullptr);
}
#endif

// The AVX-512 loop where the CPU has it and the head dim is one of its sizes; the portable loop elsewhere.
template <typename T>
void decode(at::Tensor& out, const at::Tensor& q, const at::Tensor& cache, const int64_t* tables,
            int64_t table_stride, const int64_t* lens, double scale, int64_t span) {
#if defined(__AVX512F__)
  switch (q.size(2)) {
    case 32:
      return attend_avx512<T, 2>(out, q, cache, tables, table_stride, lens, scale, span);
    case 64:
      return attend_avx512<T, 4>(out, q, cache, tables, table_stride, lens, scale, span);
    case 128:
      return attend_avx512<T, 8>(out, q, cache, tables, table_stride, lens, scale, span);
    default:
      break;
  }
#endif
  decode_impl<T>(out, q, cache, tables, table_stride, lens, scale, span);
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& layer_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && layer_cache.dim() == 5 && layer_cache.size(1) == 2,
              "q must be [D, heads, head_dim] and layer_cache [pages, 2, block_size, kv_heads, head_dim]");
  TORCH_CHECK(q.device().is_cpu() && layer_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.scalar_type() == layer_cache.scalar_type(), "q and the cache must share a dtype");
  TORCH_CHECK(q.stride(2) == 1 && layer_cache.stride(4) == 1, "q and the cache need a contiguous head dim");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_pages = layer_cache.size(0), block_size = layer_cache.size(2), num_kv_heads = layer_cache.size(3);
  TORCH_CHECK(layer_cache.size(4) == head_dim, "q's head_dim differs from the cache's");
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none), not ", window);
  const int64_t span = window > 0 ? window : kNoWindow;
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs && block_tables.stride(1) == 1,
              "block_tables must be [D, W] with contiguous rows");
  const at::Tensor lens_c = context_lens.contiguous();
  TORCH_CHECK(lens_c.dim() == 1 && lens_c.size(0) == num_seqs, "context_lens must be [D]");
  const int64_t* lens = lens_c.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t width = block_tables.size(1), table_stride = block_tables.stride(0);
  for (int64_t d = 0; d < num_seqs; ++d) {  // every page a row will read, checked before any is read
    TORCH_CHECK(lens[d] >= 0 && lens[d] <= width * block_size, "context_lens[", d, "] = ", lens[d],
                " does not fit its block table of ", width, " entries");
    for (int64_t b = window_start(lens[d], span) / block_size; b * block_size < lens[d]; ++b) {
      const int64_t page = tables[d * table_stride + b];
      TORCH_CHECK(page >= 0 && page < num_pages, "block_tables[", d, ", ", b, "] = ", page, " is not a page of ",
                  num_pages);
    }
  }
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  switch (q.scalar_type()) {
    case at::kFloat:
      decode<float>(out, q, layer_cache, tables, table_stride, lens, scale, span);
      break;
    case at::kBFloat16:
      decode<c10::BFloat16>(out, q, layer_cache, tables, table_stride, lens, scale, span);
      break;
    case at::kHalf:
      decode<c10::Half>(out, q, layer_cache, tables, table_stride, lens, scale, span);
      break;
    default:
      TORCH_CHECK(false, "float32, bfloat16 or float16 only, not ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor layer_cache, Tensor block_tables, Tensor context_lens, float scale, "
        "int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(loragate_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
