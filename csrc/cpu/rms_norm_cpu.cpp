// CPU kernels for ridgefill::rms_norm and ridgefill::rms_norm_rope (schemas in csrc/bindings.cpp;
// references and convention in ridgefill_runtime/ops/rms_norm.py and ops/norm_rope.py):
// y = (x * rsqrt(mean(x^2) + eps)).to(x.dtype) * weight per row, the mean in float32. One call replaces
// the reference's five tensor ops (pow, mean, add, rsqrt, mul) and their temporaries, which at decode
// cost more than the arithmetic itself. The sum of squares runs in 16 independent float32 lanes, then
// adds them up: vectorised under run-time ISA clones without reassociating any one lane's sum.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && defined(__ELF__)
#define RIDGEFILL_NORM_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define RIDGEFILL_NORM_CLONES
#endif

namespace {

template <typename T>
RIDGEFILL_NORM_CLONES float sum_of_squares(const T* x, int64_t n) {
  float lanes[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) {
      const float v = float(x[i + j]);
      lanes[j] += v * v;
    }
  float total = 0.f;
  for (int j = 0; j < 16; ++j) total += lanes[j];
  for (; i < n; ++i) total += float(x[i]) * float(x[i]);
  return total;
}

template <typename T>
RIDGEFILL_NORM_CLONES void scale_row(const T* x, const T* w, T* y, int64_t n, float r) {
  for (int64_t i = 0; i < n; ++i) y[i] = T(float(x[i]) * r) * w[i];  // cast, then the weight in T
}

template <typename T>
void rows(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, double eps) {
  const int64_t n = x.size(-1), count = x.numel() / std::max<int64_t>(n, 1);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  // NOTE: a decode step's one row stays on this thread: waking the pool costs more than the row
  at::parallel_for(0, count, std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1)), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float mean = sum_of_squares(xp + r * n, n) / float(n);
      scale_row(xp + r * n, wp, yp + r * n, n, 1.f / std::sqrt(mean + float(eps)));
    }
  });
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: weight dtype ", weight.scalar_type(),
              " must match x dtype ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "rms_norm: weight must be 1-D of size x.shape[-1]");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty_like(xc);
  switch (x.scalar_type()) {
    case at::kFloat: rows<float>(xc, wc, y, eps); break;
    case at::kBFloat16: rows<c10::BFloat16>(xc, wc, y, eps); break;
    case at::kHalf: rows<c10::Half>(xc, wc, y, eps); break;
    default: TORCH_CHECK(false, "rms_norm: unsupported dtype ", x.scalar_type(), " (expected float32, bfloat16 or float16)");
  }
  return y;
}

// -- rms_norm_rope: a head's RMSNorm (optional) and its rotate-half RoPE in one pass ---------------
// Reference: ridgefill_runtime/ops/norm_rope.py. float32 only. The norm is rms_norm_cpu's two functions;
// the rotation rounds as torch's mul then addcmul do on x86 (ATen's AVX2 / AVX-512 addcmul is one FMA):
// lo = fma(-x2, s, x1 * c rounded), hi = fma(x1, s, x2 * c rounded), so the kernel gives the reference's
// bits there. NOTE: fp-contract=off keeps the first product rounded (GCC would fuse it too).
__attribute__((optimize("fp-contract=off"))) RIDGEFILL_NORM_CLONES void rotate_half(const float* x, const float* c,
                                                                                   const float* s, float* y,
                                                                                   int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    const float lo = x1 * c[i], hi = x2 * c[i];  // [each rounded]
    y[i] = std::fma(-x2, s[i], lo);
    y[i + half] = std::fma(x1, s[i], hi);
  }
}

at::Tensor rms_norm_rope_cpu(const at::Tensor& x, const c10::optional<at::Tensor>& weight, const at::Tensor& cos,
                             const at::Tensor& sin, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rms_norm_rope: x, cos and sin must be float32");
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0, "rms_norm_rope: x must be [N, H, D] with D even, got ", x.sizes());
  const int64_t N = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(cos.numel() == N * half && sin.numel() == N * half, "rms_norm_rope: cos and sin must hold N * D / 2 = ",
              N * half, " values");
  const bool norm = weight.has_value() && weight->defined();
  if (norm)
    TORCH_CHECK(weight->scalar_type() == at::kFloat && weight->dim() == 1 && weight->size(0) == D,
                "rms_norm_rope: weight must be float32 [D]");
  // NOTE: heads contiguous inside a row, rows at any stride: q and k slice the fused projection's output
  const at::Tensor xc = (x.stride(2) == 1 && x.stride(1) == D) ? x : x.contiguous();
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  const at::Tensor wc = norm ? weight->contiguous() : at::Tensor();
  at::Tensor y = at::empty({N, H, D}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float *cp = cc.data_ptr<float>(), *sp = sc.data_ptr<float>();
  const float* wp = norm ? wc.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t row_stride = xc.stride(0);
  at::parallel_for(0, N * H, std::max<int64_t>(1, 32768 / std::max<int64_t>(D, 1)), [&](int64_t lo, int64_t hi) {
    std::vector<float> normed(norm ? D : 0);
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t n = r / H, h = r % H;
      const float* xr = xp + n * row_stride + h * D;
      if (norm) {
        const float mean = sum_of_squares(xr, D) / float(D);
        scale_row(xr, wp, normed.data(), D, 1.f / std::sqrt(mean + float(eps)));
        xr = normed.data();
      }
      rotate_half(xr, cp + n * half, sp + n * half, yp + r * D, half);
    }
  });
  return y;
}

// -- rms_norm_add: a residual add around RMSNorm in one pass -----------------------------------------
// Reference: ridgefill_runtime/ops/rms_norm.py. float32 only. sum = residual + (weight ? rms_norm(y) : y);
// normed = rms_norm(sum) by next_weight (empty without). The norms are rms_norm_cpu's two functions (called,
// not inlined: run-time clones), so every value is the bits of the tensor ops it replaces.
// NOTE: fp-contract=off keeps GCC from fusing a product into the residual add.
__attribute__((optimize("fp-contract=off"))) void add_row(const float* a, const float* b, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

std::tuple<at::Tensor, at::Tensor> rms_norm_add_cpu(const at::Tensor& y, const c10::optional<at::Tensor>& weight,
                                                    const at::Tensor& residual,
                                                    const c10::optional<at::Tensor>& next_weight, double eps) {
  TORCH_CHECK(y.scalar_type() == at::kFloat && residual.scalar_type() == at::kFloat,
              "rms_norm_add: y and residual must be float32");
  TORCH_CHECK(y.dim() == 2 && y.sizes() == residual.sizes(), "rms_norm_add: y and residual must be the same [N, d], got ",
              y.sizes(), " and ", residual.sizes());
  const int64_t N = y.size(0), d = y.size(1);
  const bool norm = weight.has_value() && weight->defined(), next = next_weight.has_value() && next_weight->defined();
  for (const auto* w : {norm ? &*weight : nullptr, next ? &*next_weight : nullptr})
    if (w) TORCH_CHECK(w->scalar_type() == at::kFloat && w->dim() == 1 && w->size(0) == d, "rms_norm_add: weights must be float32 [d]");
  const at::Tensor yc = y.contiguous(), rc = residual.contiguous();
  const at::Tensor wc = norm ? weight->contiguous() : at::Tensor(), nc = next ? next_weight->contiguous() : at::Tensor();
  at::Tensor sum = at::empty({N, d}, y.options());
  at::Tensor normed = next ? at::empty({N, d}, y.options()) : at::empty({0}, y.options());
  const float *yp = yc.data_ptr<float>(), *rp = rc.data_ptr<float>();
  const float *wp = norm ? wc.data_ptr<float>() : nullptr, *np = next ? nc.data_ptr<float>() : nullptr;
  float *sp = sum.data_ptr<float>(), *op = next ? normed.data_ptr<float>() : nullptr;
  const float feps = float(eps);
  at::parallel_for(0, N, std::max<int64_t>(1, 32768 / std::max<int64_t>(d, 1)), [&](int64_t lo, int64_t hi) {
    std::vector<float> tmp(norm ? d : 0);
    for (int64_t r = lo; r < hi; ++r) {
      const float* yr = yp + r * d;
      if (norm) {
        scale_row(yr, wp, tmp.data(), d, 1.f / std::sqrt(sum_of_squares(yr, d) / float(d) + feps));
        yr = tmp.data();
      }
      add_row(rp + r * d, yr, sp + r * d, d);
      if (next) scale_row(sp + r * d, np, op + r * d, d, 1.f / std::sqrt(sum_of_squares(sp + r * d, d) / float(d) + feps));
    }
  });
  return {sum, normed};
}

}  // namespace

TORCH_LIBRARY_IMPL(ridgefill, CPU, m) {
  m.impl("rms_norm_add", &rms_norm_add_cpu);
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("rms_norm_rope", &rms_norm_rope_cpu);
}
