// CUDA kernel for ridgefill::ripe_attention (schema in bindings.cpp; the
// layout and the reference are in ridgefill_runtime/ops/ripe_attention.py).
//
// One loop's attention for a block of Tq query tokens per sequence, over the
// planes the caller gathered. Query a of sequence b sits at t = t0 + a
// (t0 = cache_lens[b]) and reads key position j <= t from
//   j >= t0                  block[b, j - t0]   (the block's own K/V)
//   j <  t0 and t - j <= W   ring[b, j % C]     (near plane, recent window)
//   j <  t0 and t - j >  W   deep[b, j]         (far plane, by position)
// (seed 001 §4, Eq. 9: under RIPE near = plane r, far = plane R; the other
// cache kinds pass their one gathered plane as deep with W = 0.)
// Grid: (B * Tq, kv heads, head chunks); see gqa_attention.cuh for the block.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <limits>

#include "common.cuh"
#include "ripe_attention_kernels.cuh"
#include "dispatch.cuh"
#include "gqa_attention.cuh"

namespace ridgefill {
namespace {

PlaneStrides strides_of(const at::Tensor& t) {
  // The locator keeps the per-row stride in 32 bits.
  TORCH_CHECK(t.stride(1) >= 0 && t.stride(1) <= std::numeric_limits<int32_t>::max(),
              "ridgefill::ripe_attention: per-row strides must fit in 32 bits, got ", t.stride(1));
  return {t.stride(0), t.stride(1), t.stride(2)};
}

at::Tensor ripe_attention_cuda(const at::Tensor& q, const at::Tensor& block_k, const at::Tensor& block_v,
                               const at::Tensor& deep_k, const at::Tensor& deep_v, const at::Tensor& ring_k,
                               const at::Tensor& ring_v, const at::Tensor& cache_lens, int64_t window,
                               double scale) {
  constexpr const char* kName = "ridgefill::ripe_attention: ";
  TORCH_CHECK(q.is_cuda(), kName, "q must be a CUDA tensor, got ", q.device());
  for (const at::Tensor* t : {&block_k, &block_v, &deep_k, &deep_v, &ring_k, &ring_v, &cache_lens}) {
    TORCH_CHECK(t->device() == q.device(), kName, "all tensors must be on ", q.device(), ", got ",
                t->device());
  }
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, kName,
              "q must be float32, bfloat16 or float16, got ", dtype);
  for (const at::Tensor* t : {&block_k, &block_v, &deep_k, &deep_v, &ring_k, &ring_v}) {
    TORCH_CHECK(t->scalar_type() == dtype, kName, "all float tensors must share q's dtype ", dtype, ", got ",
                t->scalar_type());
  }
  TORCH_CHECK(cache_lens.scalar_type() == at::kInt, kName, "cache_lens must be int32, got ",
              cache_lens.scalar_type());
  TORCH_CHECK(q.dim() == 4, kName, "q must be [B, Tq, H, D], got ", q.sizes());
  TORCH_CHECK(block_k.dim() == 4 && block_v.sizes() == block_k.sizes(), kName,
              "block_k and block_v must both be [B, Tq, Hkv, D], got ", block_k.sizes(), " and ",
              block_v.sizes());
  TORCH_CHECK(deep_k.dim() == 4 && deep_v.sizes() == deep_k.sizes(), kName,
              "deep_k and deep_v must both be [B, T, Hkv, D], got ", deep_k.sizes(), " and ", deep_v.sizes());
  TORCH_CHECK(ring_k.dim() == 4 && ring_v.sizes() == ring_k.sizes(), kName,
              "ring_k and ring_v must both be [B, C, Hkv, D], got ", ring_k.sizes(), " and ", ring_v.sizes());
  const int64_t batch = q.size(0), block_len = q.size(1), heads = q.size(2), head_dim = q.size(3);
  const int64_t kv_heads = block_k.size(2);
  const int64_t deep_len = deep_k.size(1), capacity = ring_k.size(1);
  TORCH_CHECK(block_k.size(0) == batch && deep_k.size(0) == batch && ring_k.size(0) == batch &&
                  cache_lens.dim() == 1 && cache_lens.size(0) == batch,
              kName, "batch sizes differ (q ", batch, ", block ", block_k.size(0), ", deep ", deep_k.size(0),
              ", ring ", ring_k.size(0), ", cache_lens ", cache_lens.sizes(), ")");
  TORCH_CHECK(block_k.size(1) == block_len, kName, "block_k/v hold ", block_k.size(1), " tokens, q has Tq=",
              block_len);
  TORCH_CHECK(deep_k.size(2) == kv_heads && ring_k.size(2) == kv_heads && block_k.size(3) == head_dim &&
                  deep_k.size(3) == head_dim && ring_k.size(3) == head_dim,
              kName, "[Hkv, D] of block, deep and ring and q's D differ");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, kName, "H=", heads, " must be a multiple of Hkv=",
              kv_heads);
  TORCH_CHECK(head_dim >= 1 && head_dim <= kAttnMaxHeadDim, kName, "head dim D must be in [1, ",
              kAttnMaxHeadDim, "], got ", head_dim);
  TORCH_CHECK(window >= 0, kName, "window W must be >= 0, got ", window);
  TORCH_CHECK(capacity >= 1, kName, "ring_k/v need at least one slot (C >= 1), even when W == 0");
  TORCH_CHECK(window == 0 || capacity >= window, kName, "ring capacity C=", capacity, " < window W=", window,
              ": positions t0-W..t0-1 must occupy distinct slots (need C >= W)");
  // deep and ring are cache-sized: never copy them silently.
  for (const at::Tensor* t : {&deep_k, &deep_v, &ring_k, &ring_v}) {
    TORCH_CHECK(t->stride(3) == 1 || head_dim == 1, kName,
                "deep_k/v and ring_k/v need a contiguous last dim");
  }
  TORCH_CHECK(batch * block_len <= std::numeric_limits<int32_t>::max() &&
                  deep_len + block_len <= std::numeric_limits<int32_t>::max() &&
                  capacity <= std::numeric_limits<int32_t>::max() && kv_heads <= 65535,
              kName, "too large for one launch");

  const c10::cuda::CUDAGuard device_guard(q.device());
  at::Tensor out = at::empty({batch, block_len, heads, head_dim}, q.options());
  if (out.numel() == 0) return out;
  const at::Tensor qc = q.contiguous();
  // The block is small: give it a contiguous last dim if it lacks one.
  const at::Tensor bkc = (block_k.stride(3) == 1 || head_dim == 1) ? block_k : block_k.contiguous();
  const at::Tensor bvc = (block_v.stride(3) == 1 || head_dim == 1) ? block_v : block_v.contiguous();
  const at::Tensor lens_c = cache_lens.contiguous();
  const PlaneStrides s_bk = strides_of(bkc), s_bv = strides_of(bvc), s_dk = strides_of(deep_k),
                     s_dv = strides_of(deep_v), s_rk = strides_of(ring_k), s_rv = strides_of(ring_v);
  const int group = static_cast<int>(heads / kv_heads);
  const auto stream = c10::cuda::getCurrentCUDAStream();

  RIDGEFILL_DISPATCH_FLOAT_TYPES(dtype, "ripe_attention", [&] {
    RIDGEFILL_DISPATCH_HEAD_DIM(head_dim, [&] {
      const dim3 grid(static_cast<unsigned>(batch * block_len), static_cast<unsigned>(kv_heads),
                      static_cast<unsigned>(ceil_div(group, kMaxG)));
      ripe_attention_kernel<scalar_t, kDpl, kMaxG><<<grid, kAttnThreads, 0, stream>>>(
          out.data_ptr<scalar_t>(), qc.const_data_ptr<scalar_t>(), bkc.const_data_ptr<scalar_t>(),
          bvc.const_data_ptr<scalar_t>(), deep_k.const_data_ptr<scalar_t>(), deep_v.const_data_ptr<scalar_t>(),
          ring_k.const_data_ptr<scalar_t>(), ring_v.const_data_ptr<scalar_t>(),
          lens_c.const_data_ptr<int32_t>(),
          static_cast<int>(block_len), static_cast<int>(heads), static_cast<int>(head_dim), group,
          static_cast<int>(deep_len), s_bk, s_bv, s_dk, s_dv, s_rk, s_rv, static_cast<int>(capacity), window,
          static_cast<float>(scale));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

}  // namespace
}  // namespace ridgefill

TORCH_LIBRARY_IMPL(ridgefill, CUDA, m) {
  m.impl("ripe_attention", &ridgefill::ripe_attention_cuda);
}
