// CPU kernel for ridgefill::rms_norm (schema in csrc/bindings.cpp; reference and convention in
// ridgefill_runtime/ops/rms_norm.py): y = (x * rsqrt(mean(x^2) + eps)).to(x.dtype) * weight per
// row, the mean in float32. One call replaces the reference's five tensor ops (pow, mean, add,
// rsqrt, mul) and their temporaries, which at decode cost more than the arithmetic itself.
// The sum of squares runs in 16 independent float32 lanes, then adds them up: vectorised under
// run-time ISA clones without reassociating any one lane's sum.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

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

}  // namespace

TORCH_LIBRARY_IMPL(ridgefill, CPU, m) { m.impl("rms_norm", &rms_norm_cpu); }
