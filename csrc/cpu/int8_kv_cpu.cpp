// CPU kernel for ridgefill::int8_kv_write (schema in csrc/bindings.cpp): the int8 K/V cache's write
// (cache.kv_dtype = "int8"; ridgefill_runtime/cache/int8_kv.py is the definition and the fallback).
//
// Group g (values 32g .. min(32g + 32, D)) of row (n, h) of x [N, Hkv, D] goes to slab[slots[n], h] as
// round(x / s), s = max|x_g| / 127 stored in scales[slots[n], h, g]; s = 0 (an all-zero group) stores
// zeros. The same float32 operations in the same order as int8_kv.quantize (the division by 127, then
// x / s rounded half to even), so both give the same bytes: one call instead of a dozen small torch ops
// per layer and step, which at batch 1 cost more than the attention itself.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace ridgefill {
namespace {

constexpr int64_t kGroup = 32;  // int8_kv.GROUP

void quantize_rows(const at::Tensor& slab, const at::Tensor& scales, const int64_t* slots, const at::Tensor& x) {
  const int64_t n_rows = x.size(0), heads = x.size(1), D = x.size(2);
  const float* src = x.const_data_ptr<float>();
  int8_t* dst = slab.data_ptr<int8_t>();
  float* sc = scales.data_ptr<float>();
  for (int64_t n = 0; n < n_rows; ++n) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* row = src + (n * heads + h) * D;
      int8_t* out = dst + slots[n] * slab.stride(0) + h * slab.stride(1);
      float* row_scales = sc + slots[n] * scales.stride(0) + h * scales.stride(1);
      for (int64_t g = 0; g * kGroup < D; ++g) {
        const int64_t d0 = g * kGroup, d1 = std::min(D, d0 + kGroup);
        float amax = 0.0f;
        for (int64_t d = d0; d < d1; ++d) {
          const float a = std::fabs(row[d]);
          amax = (a > amax || std::isnan(a)) ? a : amax;  // NaN propagates, as torch's amax does
        }
        const float s = amax / 127.0f;
        const float div = s > 0.0f ? s : 1.0f;
        for (int64_t d = d0; d < d1; ++d) {
          const float q = std::nearbyint(row[d] / div);  // the default rounding mode: half to even
          out[d] = static_cast<int8_t>(std::isnan(q) ? 0.0f : std::fmin(127.0f, std::fmax(-127.0f, q)));
        }
        row_scales[g * scales.stride(2)] = s;
      }
    }
  }
}

void int8_kv_write_cpu(const at::Tensor& k_slab, const at::Tensor& v_slab, const at::Tensor& k_scale,
                       const at::Tensor& v_scale, const at::Tensor& slots, const at::Tensor& k, const at::Tensor& v) {
  constexpr const char* kName = "ridgefill::int8_kv_write: ";
  for (const at::Tensor* t : {&k_slab, &v_slab, &k_scale, &v_scale, &slots, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu(), kName, "all tensors must be on the CPU, got ", t->device());
  }
  TORCH_CHECK_TYPE(k_slab.scalar_type() == at::kChar && v_slab.scalar_type() == at::kChar, kName,
                   "k_slab/v_slab must be int8");
  TORCH_CHECK_TYPE(k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat, kName,
                   "k_scale/v_scale must be float32");
  TORCH_CHECK_TYPE(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, kName, "k/v must be float32");
  TORCH_CHECK_TYPE(slots.scalar_type() == at::kLong, kName, "slots must be int64");
  TORCH_CHECK_VALUE(k_slab.dim() == 3 && v_slab.sizes() == k_slab.sizes() && k_slab.stride(2) == 1 &&
                        v_slab.stride(2) == 1,
                    kName, "need k_slab = v_slab [S, Hkv, D] with a contiguous last dim");
  const int64_t num_slots = k_slab.size(0);
  for (const at::Tensor* s : {&k_scale, &v_scale}) {
    TORCH_CHECK_VALUE(s->dim() == 3 && s->size(0) == num_slots && s->size(1) == k_slab.size(1) &&
                          s->size(2) == (k_slab.size(2) + kGroup - 1) / kGroup,
                      kName, "k_scale/v_scale must be [S, Hkv, G], G = ceil(D / 32); got ", s->sizes());
  }
  TORCH_CHECK_VALUE(slots.dim() == 1 && k.dim() == 3 && k.size(0) == slots.size(0) && k.size(1) == k_slab.size(1) &&
                        k.size(2) == k_slab.size(2) && v.sizes() == k.sizes(),
                    kName, "need k = v [N, Hkv, D] and slots [N]; got ", k.sizes(), ", ", v.sizes(), ", ",
                    slots.sizes());
  const at::Tensor at_c = slots.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const int64_t* at = at_c.const_data_ptr<int64_t>();
  for (int64_t n = 0; n < slots.size(0); ++n) {
    TORCH_CHECK_INDEX(at[n] >= 0 && at[n] < num_slots, kName, "slot ", at[n], " outside the slabs' ", num_slots);
  }
  quantize_rows(k_slab, k_scale, at, kc);
  quantize_rows(v_slab, v_scale, at, vc);
}

}  // namespace
}  // namespace ridgefill

TORCH_LIBRARY_IMPL(ridgefill, CPU, m) {
  m.impl("int8_kv_write", &ridgefill::int8_kv_write_cpu);
}
