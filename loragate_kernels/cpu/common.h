// Scalar helpers the CPU ops share (loragate_kernels/cpu/lora.cpp, cpu/attention.cpp, cpu/layer.cpp,
// cpu/panels.cpp, cpu/amx.cpp, cpu/screen.cpp): conversions between the model's dtypes and fp32, e^x and SiLU, each
// written so the compiler vectorizes the loops that call them; and the GEMMs' `Ahead`.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace loragate_cpu {

#if defined(__AVX512F__)
// A thread's next run of weight (the bytes [next, end)), asked for into L2 a few lines at each of the current run's
// `steps` issue points, so that memory fetches it while the core computes (cpu/panels.cpp, cpu/amx.cpp's dot
// kernel, cpu/screen.cpp). A default one asks for nothing.
struct Ahead {
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t per_step = 0;  // lines an issue asks for
  static Ahead over(const void* begin, int64_t bytes, int64_t steps) {
    Ahead ahead;
    ahead.next = static_cast<const char*>(begin);
    ahead.end = ahead.next + bytes;
    ahead.per_step = (bytes / 64 + steps - 1) / std::max<int64_t>(steps, 1);
    return ahead;
  }
  inline void issue() {
    for (int64_t i = 0; i < per_step && next < end; ++i, next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
};
#endif

inline float to_f(float v) { return v; }
inline float to_f(c10::Half v) { return static_cast<float>(v); }
inline float to_f(c10::BFloat16 v) {  // the bits, shifted: vectorizes (c10's conversion does not always)
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline void store(float* p, float v) { *p = v; }
inline void store(c10::Half* p, float v) { *p = c10::Half(v); }
inline void store(c10::BFloat16* p, float v) {  // round to nearest even, as c10; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    p->x = static_cast<uint16_t>((bits >> 16) | 0x40u);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  p->x = static_cast<uint16_t>(bits >> 16);
}

// v as a T would hold it (stored and read back).
template <typename T>
inline float round_to(float v) {
  T t;
  store(&t, v);
  return to_f(t);
}
template <>
inline float round_to<float>(float v) {
  return v;
}

// e^x for x <= 0 in a form the compiler vectorizes (std::exp is a scalar call): x = n ln2 + r with |r| <= ln2 / 2
// (Cody-Waite: ln2 in two parts, the first exact in a few bits, so n ln2 loses nothing), e^r by Cephes' expf
// polynomial, and 2^n set in the exponent bits. Relative error ~1e-7 (fp32 rounding); below -87 the result is 0
// (e^-87 ~ 1.6e-38).
inline float exp_nonpositive(float x) {
  const float c = std::max(x, -87.f);
  const float n = std::floor(c * 1.4426950408889634f + 0.5f);
  const float r = (c - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.f ? 0.f : p * scale;
}

#if defined(__AVX512F__)
// 16 elements to and from fp32 in one AVX-512 register (bf16: the bits shifted; stores round to nearest even and
// keep NaN a NaN, as `store` does).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
#if defined(__AVX512BF16__)
  // vcvtneps2bf16: the same rounding and NaN in one instruction (it flushes fp32 denormals, below 1.2e-38, to zero)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
#endif
}
inline void store16(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Lane o of the result = the sum of a[o]'s 16 lanes: a transpose folded into the adds (45 shuffles and adds for
// 16 sums, where one horizontal sum each takes ~8).
inline __m512 transpose_sum16(const __m512 (&a)[16]) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit chunk: (a0+a2, b0+b2, a1+a3, b1+b3) of rows a = 2i, b = 2i + 1
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int j = 0; j < 4; ++j)  // per 128-bit chunk: one partial of each of rows 4j .. 4j + 3
    y[j] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * j], x[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * j], x[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
}

// e^x for 16 x <= 0 at once: `exp_nonpositive`, step for step.
inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 c = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(c, _mm512_set1_ps(1.4426950408889634f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), c));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 e = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_NLT_UQ), e);
}

// silu(x) * up for 16 x at once (cpu/layer.cpp's `silu_mul`, and cpu/panels.cpp's `panel_linear_silu` on a tile's
// sums): silu(x) = x / (1 + E) for x >= 0 and x E / (1 + E) below, from E = e^-|x| in (0, 1] so nothing overflows;
// 1 / (1 + E) as the reciprocal estimate and one Newton step (within an ulp or two of the division, whose throughput
// was half the loop's time).
inline __m512 silu_mul16(__m512 x, __m512 up) {
  const __m512 big = exp_nonpositive16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
  const __m512 num = _mm512_mask_mul_ps(x, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), x, big);
  const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), big);
  __m512 inv = _mm512_rcp14_ps(den);
  inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.f)));
  return _mm512_mul_ps(_mm512_mul_ps(num, inv), up);
}
#endif

// A row of n elements to fp32 and back (rounded to nearest even), 16 at a time where the CPU has AVX-512.
template <typename T>
inline void to_float_row(const T* src, float* dst, int64_t n) {
  int64_t e = 0;
#if defined(__AVX512F__)
  for (; e + 16 <= n; e += 16) _mm512_storeu_ps(dst + e, load16(src + e));
#endif
  for (; e < n; ++e) dst[e] = to_f(src[e]);
}

template <typename T>
inline void from_float_row(const float* src, T* dst, int64_t n) {
  int64_t e = 0;
#if defined(__AVX512F__)
  for (; e + 16 <= n; e += 16) store16(dst + e, _mm512_loadu_ps(src + e));
#endif
  for (; e < n; ++e) store(dst + e, src[e]);
}

}  // namespace loragate_cpu
