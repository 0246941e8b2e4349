// The CPU path's fused elementwise ops of a decoder layer (loragate_kernels/cpu/build.py builds this file,
// loragate_kernels/cpu/ops.py documents each op; engine/model/layer_ops.py `TorchLayerOps` is the torch twin and the
// test oracle). In torch each of these is 3-8 ops with a tensor between each (RMSNorm alone is pow, mean, add, rsqrt,
// mul, mul on a CPU): one pass over the rows here, in fp32, rounded once to the model's dtype.
//
//   rms_norm(x, w, eps)                 x * rsqrt(mean(x^2) + eps) * w                     -> new [T, n], x's dtype
//   add_rms_norm(residual!, x, w, eps)  residual += x (rounded to residual's dtype: x's, or fp32), then
//                                       rms_norm(residual, w, eps)                         -> new [T, n], x's dtype
//   silu_mul(gate_up)                   silu(gate_up[:, :I]) * gate_up[:, I:]              -> new [T, I]
//   gelu_tanh_mul(gate_up)              gelu_tanh(gate_up[:, :I]) * gate_up[:, I:]         -> new [T, I]
//                                       (the activation rounded to the model's dtype before the product, as HF's
//                                       modeling code and the torch twin compute it)
//   rope_write_kv(qkv!, cos, sin, layer_cache!, k_rows, v_rows, num_heads, q_norm?, k_norm?, eps)
//       q and k heads of qkv [T, (H + 2 kvh) * hd] rotated in place (x * cos + roll(x, rot/2) * sin over each head's
//       first rot dims, rot = cos's width <= hd, the rest passed through; the sign of rotate_half folded into sin),
//       each head first RMS-normed over hd times q_norm / k_norm where they are given; then each token's k and v
//       written into the cache's rows k_rows / v_rows (a layer's cache viewed as [rows, kvh, hd];
//       engine/model/attention.py `key_rows`).
//
// The norms' weights may be of any of the three dtypes whatever x's (Gemma 3 keeps its (1 + w) in fp32): they are
// read into fp32 once per call.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "common.h"

namespace {

using loragate_cpu::exp_nonpositive;
using loragate_cpu::from_float_row;
using loragate_cpu::to_float_row;

// Rows per task: enough elements that a task outweighs handing it to a thread.
int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems)); }

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous columns");
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

template <typename F>
void dispatch(at::ScalarType type, const F& f) {
  switch (type) {
    case at::kFloat:
      f(float{});
      break;
    case at::kBFloat16:
      f(c10::BFloat16{});
      break;
    case at::kHalf:
      f(c10::Half{});
      break;
    default:
      TORCH_CHECK(false, "float32, bfloat16 or float16 only, not ", type);
  }
}

// A norm's weight [n] (any of the three dtypes) as fp32.
std::vector<float> float_weight(const at::Tensor& w, int64_t n, const char* name) {
  TORCH_CHECK(w.dim() == 1 && w.size(0) == n && w.is_contiguous() && w.device().is_cpu(), name,
              " must be a contiguous CPU [", n, "]");
  std::vector<float> wf(n);
  dispatch(w.scalar_type(), [&](auto tag) {
    using W = decltype(tag);
    to_float_row(w.data_ptr<W>(), wf.data(), n);
  });
  return wf;
}

#if defined(__AVX512F__)
using loragate_cpu::exp_nonpositive16;
using loragate_cpu::load16;
using loragate_cpu::silu_mul16;
using loragate_cpu::store16;

// A row of n = 16 k: two passes, each 16 columns at a time (the sum, the residual's rounding and the fp32 copy of the
// row in the first; the scaling in the second), where the loop below makes five. The residual (in, res) is of type R,
// the added row and the output of type X.
template <typename R, typename X>
void norm_row16(const R* in, const X* add, R* res, const float* wf, X* out, float* r, int64_t n, float eps) {
  __m512 ss0 = _mm512_setzero_ps(), ss1 = _mm512_setzero_ps();
  for (int64_t e = 0; e < n; e += 16) {
    __m512 v = load16(in + e);
    if (add != nullptr) {  // residual (in) += add, rounded as the residual's dtype holds it
      store16(res + e, _mm512_add_ps(v, load16(add + e)));
      v = load16(res + e);
    }
    _mm512_storeu_ps(r + e, v);
    if ((e & 16) == 0) {
      ss0 = _mm512_fmadd_ps(v, v, ss0);
    } else {
      ss1 = _mm512_fmadd_ps(v, v, ss1);
    }
  }
  const float ss = _mm512_reduce_add_ps(_mm512_add_ps(ss0, ss1));
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(ss / static_cast<float>(n) + eps));
  for (int64_t e = 0; e < n; e += 16)
    store16(out + e, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(r + e), inv), _mm512_loadu_ps(wf + e)));
}
#endif

// in and res (the residual) are of type R, add and out of type X; add == nullptr: a plain norm of `in`.
template <typename R, typename X>
void norm_rows(const R* in, int64_t in_stride, const X* add, int64_t add_stride, R* res, int64_t res_stride,
               const float* wf, X* out, int64_t out_stride, int64_t rows, int64_t n, float eps) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    at::parallel_for(0, rows, grain(n), [&](int64_t lo, int64_t hi) {
      std::vector<float> row(n);
      for (int64_t t = lo; t < hi; ++t)
        norm_row16(in + t * in_stride, add == nullptr ? nullptr : add + t * add_stride, res + t * res_stride, wf,
                   out + t * out_stride, row.data(), n, eps);
    });
    return;
  }
#endif
  at::parallel_for(0, rows, grain(n), [&](int64_t lo, int64_t hi) {
    std::vector<float> row(n), other(n);
    float* r = row.data();
    for (int64_t t = lo; t < hi; ++t) {
      to_float_row(in + t * in_stride, r, n);
      if (add != nullptr) {  // residual (in) += add, rounded as the residual's dtype holds it
        to_float_row(add + t * add_stride, other.data(), n);
#pragma omp simd
        for (int64_t e = 0; e < n; ++e) r[e] += other[e];
        from_float_row(r, res + t * res_stride, n);
        to_float_row(res + t * res_stride, r, n);
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t e = 0; e < n; ++e) ss += r[e] * r[e];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
      for (int64_t e = 0; e < n; ++e) r[e] = r[e] * inv * wf[e];
      from_float_row(r, out + t * out_stride, n);
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  const std::vector<float> wf = float_weight(weight, x.size(1), "weight");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    norm_rows<T, T>(x.data_ptr<T>(), x.stride(0), nullptr, 0, nullptr, 0, wf.data(), out.data_ptr<T>(),
                    out.stride(0), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(residual, "residual");
  check_rows(x, "x");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x must match residual's shape");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() || residual.scalar_type() == at::kFloat,
              "residual must be float32 or of x's dtype");
  const std::vector<float> wf = float_weight(weight, x.size(1), "weight");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const auto run = [&](auto* res) {
      norm_rows(res, residual.stride(0), x.data_ptr<T>(), x.stride(0), res, residual.stride(0), wf.data(),
                out.data_ptr<T>(), out.stride(0), x.size(0), x.size(1), static_cast<float>(eps));
    };
    if (residual.scalar_type() == x.scalar_type()) {
      run(residual.data_ptr<T>());
    } else {
      run(residual.data_ptr<float>());
    }
  });
  return out;
}

// The gated MLP's activations: gate[e] = act(gate[e]) * up[e]. Both are x * sigmoid(z): silu with z = x, gelu_tanh
// (0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3)) with z = 2u. x * sigmoid(z) from E = e^-|z| in (0, 1], so
// nothing overflows: x / (1 + E) for z >= 0, x E / (1 + E) below (z has x's sign).
enum class Act { kSilu, kGeluTanh };

constexpr float kGelu1 = 1.5957691216057308f;              // 2 sqrt(2 / pi)
constexpr float kGelu3 = 1.5957691216057308f * 0.044715f;  // its x^3 term

template <Act A>
inline float act_arg(float x) {
  return A == Act::kSilu ? x : x * (kGelu1 + kGelu3 * x * x);
}

// Plain fp32 arrays: the loop vectorizes.
template <Act A>
void act_mul_f32(float* __restrict gate, const float* __restrict up, int64_t n) {
#pragma omp simd
  for (int64_t e = 0; e < n; ++e) {
    const float x = gate[e];
    const float big = exp_nonpositive(-std::fabs(act_arg<A>(x)));
    gate[e] = x * (x >= 0.f ? 1.f : big) / (1.f + big) * up[e];
  }
}

#if defined(__AVX512F__)
// gelu_tanh(x) * up for 16 x at once: common.h's `silu_mul16` with z = 2u.
inline __m512 gelu_tanh_mul16(__m512 x, __m512 up) {
  const __m512 z = _mm512_mul_ps(x, _mm512_fmadd_ps(_mm512_mul_ps(x, x), _mm512_set1_ps(kGelu3),
                                                    _mm512_set1_ps(kGelu1)));
  const __m512 big = exp_nonpositive16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(z)));
  const __m512 num = _mm512_mask_mul_ps(x, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), x, big);
  const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), big);
  __m512 inv = _mm512_rcp14_ps(den);
  inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.f)));
  return _mm512_mul_ps(_mm512_mul_ps(num, inv), up);
}

template <Act A>
inline __m512 act_mul16(__m512 x, __m512 up) {
  return A == Act::kSilu ? silu_mul16(x, up) : gelu_tanh_mul16(x, up);
}
#endif

template <Act A>
at::Tensor gated_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even number of columns");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  dispatch(gate_up.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* in = gate_up.data_ptr<T>();
    T* o = out.data_ptr<T>();
    const int64_t in_stride = gate_up.stride(0);
    at::parallel_for(0, rows, grain(n), [&](int64_t lo, int64_t hi) {
      std::vector<float> gate(n), up(n), ones(n, 1.f);
      for (int64_t t = lo; t < hi; ++t) {
        const T* g = in + t * in_stride;
        T* dst = o + t * n;
        // The activation is rounded to T before the product, as HF computes act(gate) * up in the model's dtype: in
        // bf16 keeping it in fp32 moved a SmolLM2 greedy answer off HF's (docs/performance.md, *bf16 against HF's
        // bf16*) without bringing the text's log-probabilities closer to fp32's.
#if defined(__AVX512F__)
        if (n % 16 == 0) {
          const __m512 one = _mm512_set1_ps(1.f);
          for (int64_t e = 0; e < n; e += 16) {
            store16(dst + e, act_mul16<A>(load16(g + e), one));
            store16(dst + e, _mm512_mul_ps(load16(dst + e), load16(g + n + e)));
          }
          continue;
        }
#endif
        to_float_row(g, gate.data(), n);
        to_float_row(g + n, up.data(), n);
        act_mul_f32<A>(gate.data(), ones.data(), n);
        from_float_row(gate.data(), dst, n);
        to_float_row(dst, gate.data(), n);
        for (int64_t e = 0; e < n; ++e) gate[e] *= up[e];
        from_float_row(gate.data(), dst, n);
      }
    });
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) { return gated_mul<Act::kSilu>(gate_up); }
at::Tensor gelu_tanh_mul(const at::Tensor& gate_up) { return gated_mul<Act::kGeluTanh>(gate_up); }

// One q or k head of hd elements in place: RMS-normed times w (statistics in fp32) where `Normed`, then its first rot
// dims rotated (pairs e and e + rot/2) by c, s [rot]; x [hd] is scratch. `Normed` is a template argument so the plain
// head's loop carries no test of it.
template <typename T, bool Normed>
void rope_head(T* head, const float* c, const float* s, const float* w, float eps, int64_t hd, int64_t rot,
               float* x) {
  const int64_t half = rot / 2;
#if defined(__AVX512F__)
  if (half % 16 == 0 && (!Normed || hd % 16 == 0)) {  // 16 columns of both halves at a time, in registers
    __m512 inv = _mm512_set1_ps(1.f);
    if constexpr (Normed) {
      __m512 ss = _mm512_setzero_ps();
      for (int64_t e = 0; e < hd; e += 16) {
        const __m512 v = load16(head + e);
        ss = _mm512_fmadd_ps(v, v, ss);
      }
      inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(hd) + eps));
    }
    for (int64_t e = 0; e < half; e += 16) {
      __m512 lo_x = load16(head + e), hi_x = load16(head + half + e);
      if constexpr (Normed) {
        lo_x = _mm512_mul_ps(_mm512_mul_ps(lo_x, inv), _mm512_loadu_ps(w + e));
        hi_x = _mm512_mul_ps(_mm512_mul_ps(hi_x, inv), _mm512_loadu_ps(w + half + e));
      }
      store16(head + e,
              _mm512_fmadd_ps(lo_x, _mm512_loadu_ps(c + e), _mm512_mul_ps(hi_x, _mm512_loadu_ps(s + e))));
      store16(head + half + e, _mm512_fmadd_ps(hi_x, _mm512_loadu_ps(c + half + e),
                                               _mm512_mul_ps(lo_x, _mm512_loadu_ps(s + half + e))));
    }
    if constexpr (Normed) {  // the dims past rot are normed, not rotated
      for (int64_t e = rot; e < hd; e += 16)
        store16(head + e, _mm512_mul_ps(_mm512_mul_ps(load16(head + e), inv), _mm512_loadu_ps(w + e)));
    }
    return;
  }
#endif
  to_float_row(head, x, Normed ? hd : rot);
  if constexpr (Normed) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t e = 0; e < hd; ++e) ss += x[e] * x[e];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(hd) + eps);
#pragma omp simd
    for (int64_t e = 0; e < hd; ++e) x[e] = x[e] * inv * w[e];
  }
#pragma omp simd
  for (int64_t e = 0; e < half; ++e) {
    const float lo_x = x[e], hi_x = x[e + half];
    x[e] = lo_x * c[e] + hi_x * s[e];
    x[e + half] = hi_x * c[e + half] + lo_x * s[e + half];
  }
  from_float_row(x, head, Normed ? hd : rot);  // unnormed dims past rot stay as they were
}

// A token's q and k heads (row: q | k | v), each through `rope_head`: the q heads normed by qw, the k heads by kw.
template <typename T, bool Normed>
void rope_row(T* row, const float* c, const float* s, const float* qw, const float* kw, float eps, int64_t num_heads,
              int64_t rotated, int64_t hd, int64_t rot, float* x) {
  for (int64_t h = 0; h < rotated; ++h)
    rope_head<T, Normed>(row + h * hd, c, s, h < num_heads ? qw : kw, eps, hd, rot, x);
}

void rope_write_kv(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& layer_cache,
                   const at::Tensor& k_rows, const at::Tensor& v_rows, int64_t num_heads,
                   const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, double eps) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(layer_cache.dim() == 5 && layer_cache.size(1) == 2 && layer_cache.is_contiguous(),
              "layer_cache must be a contiguous [pages, 2, block_size, kv_heads, head_dim]");
  TORCH_CHECK(layer_cache.device().is_cpu(), "layer_cache must be a CPU tensor");
  TORCH_CHECK(layer_cache.scalar_type() == qkv.scalar_type(), "qkv and the cache must share a dtype");
  const int64_t tokens = qkv.size(0), kv_heads = layer_cache.size(3), hd = layer_cache.size(4);
  TORCH_CHECK(hd % 2 == 0 && num_heads > 0 && qkv.size(1) == (num_heads + 2 * kv_heads) * hd,
              "qkv must be [T, (num_heads + 2 * kv_heads) * head_dim] with an even head_dim");
  const int64_t rot = tokens == 0 ? hd : cos.numel() / tokens;
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() >= 1 && t->size(0) == tokens &&
                    t->numel() == tokens * rot && rot > 0 && rot % 2 == 0 && rot <= hd,
                "cos and sin must be contiguous float32 [T, (1,) rot] with an even rot <= head_dim ", hd);
  }
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm come together");
  std::vector<float> qw, kw;
  if (q_norm.has_value()) {
    qw = float_weight(*q_norm, hd, "q_norm");
    kw = float_weight(*k_norm, hd, "k_norm");
  }
  const float* qwp = q_norm.has_value() ? qw.data() : nullptr;
  const float* kwp = q_norm.has_value() ? kw.data() : nullptr;
  const int64_t num_rows = layer_cache.numel() / (kv_heads * hd);
  for (const at::Tensor* t : {&k_rows, &v_rows}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->size(0) == tokens && t->is_contiguous(),
                "k_rows and v_rows must be contiguous int64 [T]");
    const int64_t* r = t->data_ptr<int64_t>();
    for (int64_t i = 0; i < tokens; ++i) {  // every row written, checked before any is
      TORCH_CHECK(r[i] >= 0 && r[i] < num_rows, "cache row ", r[i], " of token ", i, " is not one of ", num_rows);
    }
  }
  const int64_t rotated = num_heads + kv_heads, row_elems = kv_heads * hd;
  const float epsf = static_cast<float>(eps);
  dispatch(qkv.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    T* base = qkv.data_ptr<T>();
    T* cache = layer_cache.data_ptr<T>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    const int64_t* kr = k_rows.data_ptr<int64_t>();
    const int64_t* vr = v_rows.data_ptr<int64_t>();
    const int64_t stride = qkv.stride(0);
    at::parallel_for(0, tokens, grain(qkv.size(1)), [&](int64_t lo, int64_t hi) {
      std::vector<float> x(hd);
      for (int64_t t = lo; t < hi; ++t) {
        T* row = base + t * stride;
        const float* c = cp + t * rot;
        const float* s = sp + t * rot;
        if (qwp != nullptr) {
          rope_row<T, true>(row, c, s, qwp, kwp, epsf, num_heads, rotated, hd, rot, x.data());
        } else {
          rope_row<T, false>(row, c, s, nullptr, nullptr, epsf, num_heads, rotated, hd, rot, x.data());
        }
        std::memcpy(cache + kr[t] * row_elems, row + num_heads * hd, row_elems * sizeof(T));
        std::memcpy(cache + vr[t] * row_elems, row + rotated * hd, row_elems * sizeof(T));
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_tanh_mul(Tensor gate_up) -> Tensor");
  m.def("rope_write_kv(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) layer_cache, Tensor k_rows, "
        "Tensor v_rows, int num_heads, Tensor? q_norm=None, Tensor? k_norm=None, float eps=1e-6) -> ()");
}

TORCH_LIBRARY_IMPL(loragate_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("gelu_tanh_mul", &gelu_tanh_mul);
  m.impl("rope_write_kv", &rope_write_kv);
}
