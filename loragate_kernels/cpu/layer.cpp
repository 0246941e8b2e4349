// The CPU path's fused elementwise ops of a decoder layer (loragate_kernels/cpu/build.py builds this file,
// loragate_kernels/cpu/ops.py documents each op; engine/model/layer_ops.py `TorchLayerOps` is the torch twin and the
// test oracle). In torch each of these is 3-8 ops with a tensor between each (RMSNorm alone is pow, mean, add, rsqrt,
// mul, mul on a CPU): one pass over the rows here, in fp32, rounded once to the model's dtype.
//
//   rms_norm(x, w, eps)                 x * rsqrt(mean(x^2) + eps) * w                     -> new [T, n]
//   add_rms_norm(residual!, x, w, eps)  residual += x (rounded to its dtype), then rms_norm(residual, w, eps)
//   silu_mul(gate_up)                   silu(gate_up[:, :I]) * gate_up[:, I:]              -> new [T, I]
//   rope_write_kv(qkv!, cos, sin, layer_cache!, k_rows, v_rows, num_heads)
//       q and k heads of qkv [T, (H + 2 kvh) * hd] rotated in place (x * cos + roll(x, hd/2) * sin, the sign of
//       rotate_half folded into sin), then each token's k and v written into the cache's rows k_rows / v_rows
//       (a layer's cache viewed as [rows, kvh, hd]; engine/model/attention.py `key_rows`).

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

#if defined(__AVX512F__)
using loragate_cpu::load16;
using loragate_cpu::silu_mul16;
using loragate_cpu::store16;

// A row of n = 16 k: two passes, each 16 columns at a time (the sum, the residual's rounding and the fp32 copy of the
// row in the first; the scaling in the second), where the loop below makes five.
template <typename T>
void norm_row16(const T* in, const T* add, T* res, const float* wf, T* out, float* r, int64_t n, float eps) {
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

template <typename T>
void norm_rows(const T* in, int64_t in_stride, const T* add, int64_t add_stride, T* res, int64_t res_stride,
               const T* w, T* out, int64_t out_stride, int64_t rows, int64_t n, float eps) {
  std::vector<float> wf(n);
  to_float_row(w, wf.data(), n);
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    at::parallel_for(0, rows, grain(n), [&](int64_t lo, int64_t hi) {
      std::vector<float> row(n);
      for (int64_t t = lo; t < hi; ++t)
        norm_row16(in + t * in_stride, add == nullptr ? nullptr : add + t * add_stride, res + t * res_stride,
                   wf.data(), out + t * out_stride, row.data(), n, eps);
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

void check_norm(const at::Tensor& x, const at::Tensor& weight) {
  check_rows(x, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "weight must be contiguous [", x.size(1), "]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x must share a dtype");
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

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    norm_rows<T>(x.data_ptr<T>(), x.stride(0), nullptr, 0, nullptr, 0, weight.data_ptr<T>(), out.data_ptr<T>(),
                 out.stride(0), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(residual, weight);
  check_rows(x, "x");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "x must match residual's shape and dtype");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    T* res = residual.data_ptr<T>();
    norm_rows<T>(res, residual.stride(0), x.data_ptr<T>(), x.stride(0), res, residual.stride(0),
                 weight.data_ptr<T>(), out.data_ptr<T>(), out.stride(0), x.size(0), x.size(1),
                 static_cast<float>(eps));
  });
  return out;
}

// gate[e] = silu(gate[e]) * up[e]. silu(x) = x / (1 + e^-x), from E = e^-|x| in (0, 1] so nothing overflows:
// x / (1 + E) for x >= 0, x E / (1 + E) below. Plain fp32 arrays: the loop vectorizes.
void silu_mul_f32(float* __restrict gate, const float* __restrict up, int64_t n) {
#pragma omp simd
  for (int64_t e = 0; e < n; ++e) {
    const float x = gate[e];
    const float big = exp_nonpositive(-std::fabs(x));
    gate[e] = x * (x >= 0.f ? 1.f : big) / (1.f + big) * up[e];
  }
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
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
      std::vector<float> gate(n), up(n);
      for (int64_t t = lo; t < hi; ++t) {
        const T* g = in + t * in_stride;
        T* dst = o + t * n;
#if defined(__AVX512F__)
        if (n % 16 == 0) {
          for (int64_t e = 0; e < n; e += 16) store16(dst + e, silu_mul16(load16(g + e), load16(g + n + e)));
          continue;
        }
#endif
        to_float_row(g, gate.data(), n);
        to_float_row(g + n, up.data(), n);
        silu_mul_f32(gate.data(), up.data(), n);
        from_float_row(gate.data(), dst, n);
      }
    });
  });
  return out;
}

void rope_write_kv(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& layer_cache,
                   const at::Tensor& k_rows, const at::Tensor& v_rows, int64_t num_heads) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(layer_cache.dim() == 5 && layer_cache.size(1) == 2 && layer_cache.is_contiguous(),
              "layer_cache must be a contiguous [pages, 2, block_size, kv_heads, head_dim]");
  TORCH_CHECK(layer_cache.device().is_cpu(), "layer_cache must be a CPU tensor");
  TORCH_CHECK(layer_cache.scalar_type() == qkv.scalar_type(), "qkv and the cache must share a dtype");
  const int64_t tokens = qkv.size(0), kv_heads = layer_cache.size(3), hd = layer_cache.size(4);
  TORCH_CHECK(hd % 2 == 0 && num_heads > 0 && qkv.size(1) == (num_heads + 2 * kv_heads) * hd,
              "qkv must be [T, (num_heads + 2 * kv_heads) * head_dim] with an even head_dim");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == tokens * hd &&
                    t->size(0) == tokens,
                "cos and sin must be contiguous float32 [T, (1,) head_dim]");
  }
  const int64_t num_rows = layer_cache.numel() / (kv_heads * hd);
  for (const at::Tensor* t : {&k_rows, &v_rows}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->size(0) == tokens && t->is_contiguous(),
                "k_rows and v_rows must be contiguous int64 [T]");
    const int64_t* r = t->data_ptr<int64_t>();
    for (int64_t i = 0; i < tokens; ++i) {  // every row written, checked before any is
      TORCH_CHECK(r[i] >= 0 && r[i] < num_rows, "cache row ", r[i], " of token ", i, " is not one of ", num_rows);
    }
  }
  const int64_t half = hd / 2, rotated = num_heads + kv_heads, row_elems = kv_heads * hd;
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
      std::vector<float> x(hd), y(hd);
      for (int64_t t = lo; t < hi; ++t) {
        T* row = base + t * stride;
        const float* c = cp + t * hd;
        const float* s = sp + t * hd;
        for (int64_t h = 0; h < rotated; ++h) {
          T* head = row + h * hd;
#if defined(__AVX512F__)
          if (half % 16 == 0) {  // both halves 16 columns at a time, in registers
            for (int64_t e = 0; e < half; e += 16) {
              const __m512 lo_x = load16(head + e), hi_x = load16(head + half + e);
              store16(head + e, _mm512_fmadd_ps(lo_x, _mm512_loadu_ps(c + e),
                                                _mm512_mul_ps(hi_x, _mm512_loadu_ps(s + e))));
              store16(head + half + e, _mm512_fmadd_ps(hi_x, _mm512_loadu_ps(c + half + e),
                                                       _mm512_mul_ps(lo_x, _mm512_loadu_ps(s + half + e))));
            }
            continue;
          }
#endif
          to_float_row(head, x.data(), hd);
#pragma omp simd
          for (int64_t e = 0; e < half; ++e) y[e] = x[e] * c[e] + x[e + half] * s[e];
#pragma omp simd
          for (int64_t e = half; e < hd; ++e) y[e] = x[e] * c[e] + x[e - half] * s[e];
          from_float_row(y.data(), head, hd);
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
  m.def("rope_write_kv(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) layer_cache, Tensor k_rows, "
        "Tensor v_rows, int num_heads) -> ()");
}

TORCH_LIBRARY_IMPL(loragate_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope_write_kv", &rope_write_kv);
}
