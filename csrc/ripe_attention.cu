// CUDA kernel for ridgefill::ripe_attention (schema in bindings.cpp; the
// storage layout and the reference are in ridgefill_runtime/ops/ripe_attention.py).
//
// RIPE read policy (seed 001, §4, Eq. 9), loop r of query position t reading
// key position j <= t of the same sequence:
//   j in this block (j >= t0)           -> ring plane r   (computed this pass)
//   t - j <= W                          -> ring plane r   (recent window)
//   otherwise                           -> deep plane     (deepest loop R)
// except the deepest loop itself (loop == num_ring_planes), which reads the
// deep plane everywhere, block positions included. Ring slot of j: j % C.
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
#include "dispatch.cuh"
#include "gqa_attention.cuh"

namespace ridgefill {
namespace {

template <typename scalar_t>
struct RipeLocator {
  const scalar_t* deep_k;  // deep_k[b, 0, kv_head, 0]
  const scalar_t* deep_v;
  const scalar_t* ring_k;  // ring_k[b, loop, 0, kv_head, 0] (unused when deep_only)
  const scalar_t* ring_v;
  int64_t deep_k_pos_stride, deep_v_pos_stride;
  int64_t ring_k_slot_stride, ring_v_slot_stride;
  int64_t t;      // query position
  int64_t t0;     // first block position (= cached positions before the block)
  int64_t window;
  int capacity;   // ring slots C
  bool deep_only;

  __device__ __forceinline__ bool from_ring(int j) const {
    return !deep_only && (j >= t0 || t - j <= window);
  }
  __device__ __forceinline__ const scalar_t* k(int j) const {
    return from_ring(j) ? ring_k + static_cast<int64_t>(j % capacity) * ring_k_slot_stride
                        : deep_k + j * deep_k_pos_stride;
  }
  __device__ __forceinline__ const scalar_t* v(int j) const {
    return from_ring(j) ? ring_v + static_cast<int64_t>(j % capacity) * ring_v_slot_stride
                        : deep_v + j * deep_v_pos_stride;
  }
};

template <typename scalar_t, int DPL, int MAXG>
__global__ void __launch_bounds__(kAttnThreads)
    ripe_attention_kernel(scalar_t* __restrict__ out,            // [B, Tq, H, D]
                          const scalar_t* __restrict__ q,        // [B, Tq, H, D]
                          const scalar_t* __restrict__ deep_k,   // [B, T, Hkv, D]
                          const scalar_t* __restrict__ deep_v,
                          const scalar_t* __restrict__ ring_k,   // [B, P, C, Hkv, D]
                          const scalar_t* __restrict__ ring_v,
                          const int32_t* __restrict__ cache_lens,  // [B]
                          int block_len, int num_heads, int head_dim, int group,
                          int64_t dk_b, int64_t dk_t, int64_t dk_h,
                          int64_t dv_b, int64_t dv_t, int64_t dv_h,
                          int64_t rk_b, int64_t rk_p, int64_t rk_c, int64_t rk_h,
                          int64_t rv_b, int64_t rv_p, int64_t rv_c, int64_t rv_h,
                          int loop, int capacity, int64_t window, bool deep_only, float scale) {
  __shared__ AttnSmem<MAXG> smem;
  const int row = blockIdx.x;  // b * Tq + i
  const int b = row / block_len;
  const int i = row % block_len;
  const int kv_head = blockIdx.y;
  const int head0 = kv_head * group + blockIdx.z * MAXG;
  const int g_count = min(MAXG, group - static_cast<int>(blockIdx.z) * MAXG);
  const int64_t t0 = cache_lens[b];
  const int64_t t = t0 + i;

  RipeLocator<scalar_t> loc;
  loc.deep_k = deep_k + b * dk_b + kv_head * dk_h;
  loc.deep_v = deep_v + b * dv_b + kv_head * dv_h;
  loc.ring_k = deep_only ? nullptr : ring_k + b * rk_b + loop * rk_p + kv_head * rk_h;
  loc.ring_v = deep_only ? nullptr : ring_v + b * rv_b + loop * rv_p + kv_head * rv_h;
  loc.deep_k_pos_stride = dk_t;
  loc.deep_v_pos_stride = dv_t;
  loc.ring_k_slot_stride = rk_c;
  loc.ring_v_slot_stride = rv_c;
  loc.t = t;
  loc.t0 = t0;
  loc.window = window;
  loc.capacity = capacity;
  loc.deep_only = deep_only;

  const int64_t row_off = (static_cast<int64_t>(row) * num_heads + head0) * head_dim;
  attend_rows<scalar_t, DPL, MAXG, false>(q + row_off, head_dim, out + row_off, head_dim, g_count,
                                          static_cast<int>(t + 1), head_dim, scale, loc, nullptr, smem);
}

at::Tensor ripe_attention_cuda(const at::Tensor& q, const at::Tensor& deep_k, const at::Tensor& deep_v,
                               const at::Tensor& ring_k, const at::Tensor& ring_v,
                               const at::Tensor& cache_lens, int64_t loop, int64_t window, double scale) {
  constexpr const char* kName = "ridgefill::ripe_attention: ";
  TORCH_CHECK(q.is_cuda(), kName, "q must be a CUDA tensor, got ", q.device());
  for (const at::Tensor* t : {&deep_k, &deep_v, &ring_k, &ring_v, &cache_lens}) {
    TORCH_CHECK(t->device() == q.device(), kName, "all tensors must be on ", q.device(), ", got ",
                t->device());
  }
  TORCH_CHECK(q.dim() == 4, kName, "q must be [B, Tq, H, D], got ", q.sizes());
  TORCH_CHECK(deep_k.dim() == 4 && deep_v.sizes() == deep_k.sizes(), kName,
              "deep_k and deep_v must both be [B, T, Hkv, D]");
  TORCH_CHECK(ring_k.dim() == 5 && ring_v.sizes() == ring_k.sizes(), kName,
              "ring_k and ring_v must both be [B, P, C, Hkv, D]");
  const int64_t batch = q.size(0), block_len = q.size(1), heads = q.size(2), head_dim = q.size(3);
  const int64_t kv_heads = deep_k.size(2);
  const int64_t planes = ring_k.size(1), capacity = ring_k.size(2);
  TORCH_CHECK(deep_k.size(0) == batch && ring_k.size(0) == batch, kName, "batch sizes differ");
  TORCH_CHECK(deep_k.size(3) == head_dim && ring_k.size(4) == head_dim && ring_k.size(3) == kv_heads, kName,
              "head counts/dims of q, deep and ring planes differ");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, kName, "H=", heads, " must be a multiple of Hkv=",
              kv_heads);
  TORCH_CHECK(head_dim >= 1 && head_dim <= kAttnMaxHeadDim, kName, "head dim must be in [1, ",
              kAttnMaxHeadDim, "]");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, kName,
              "unsupported dtype ", dtype);
  for (const at::Tensor* t : {&deep_k, &deep_v, &ring_k, &ring_v}) {
    TORCH_CHECK(t->scalar_type() == dtype, kName, "q and the planes must share a dtype");
    TORCH_CHECK(t->stride(-1) == 1, kName, "planes need a contiguous last dim");
  }
  TORCH_CHECK(cache_lens.scalar_type() == at::kInt && cache_lens.dim() == 1 && cache_lens.size(0) == batch,
              kName, "cache_lens must be int32 [B]");
  TORCH_CHECK(window >= 0, kName, "window must be >= 0");
  TORCH_CHECK(loop >= 0 && loop <= planes, kName, "loop must be in [0, ", planes, "]");
  const bool deep_only = loop == planes;
  TORCH_CHECK(deep_only || capacity >= window + block_len, kName, "ring capacity C=", capacity,
              " must hold the window and the block (W + Tq = ", window + block_len, ")");
  TORCH_CHECK(batch * block_len <= std::numeric_limits<int32_t>::max() &&
                  deep_k.size(1) + block_len <= std::numeric_limits<int32_t>::max(),
              kName, "too large for one launch");

  const c10::cuda::CUDAGuard device_guard(q.device());
  at::Tensor out = at::empty({batch, block_len, heads, head_dim}, q.options());
  if (out.numel() == 0) return out;
  const at::Tensor qc = q.contiguous();
  const at::Tensor lens_c = cache_lens.contiguous();
  const int group = static_cast<int>(heads / kv_heads);
  const auto stream = c10::cuda::getCurrentCUDAStream();

  RIDGEFILL_DISPATCH_FLOAT_TYPES(dtype, "ripe_attention", [&] {
    RIDGEFILL_DISPATCH_HEAD_DIM(head_dim, [&] {
      const dim3 grid(static_cast<unsigned>(batch * block_len), static_cast<unsigned>(kv_heads),
                      static_cast<unsigned>(ceil_div(group, kMaxG)));
      ripe_attention_kernel<scalar_t, kDpl, kMaxG><<<grid, kAttnThreads, 0, stream>>>(
          out.data_ptr<scalar_t>(), qc.const_data_ptr<scalar_t>(), deep_k.const_data_ptr<scalar_t>(),
          deep_v.const_data_ptr<scalar_t>(), ring_k.const_data_ptr<scalar_t>(),
          ring_v.const_data_ptr<scalar_t>(), lens_c.const_data_ptr<int32_t>(), static_cast<int>(block_len),
          static_cast<int>(heads), static_cast<int>(head_dim), group, deep_k.stride(0), deep_k.stride(1),
          deep_k.stride(2), deep_v.stride(0), deep_v.stride(1), deep_v.stride(2), ring_k.stride(0),
          ring_k.stride(1), ring_k.stride(2), ring_k.stride(3), ring_v.stride(0), ring_v.stride(1),
          ring_v.stride(2), ring_v.stride(3), static_cast<int>(loop), static_cast<int>(capacity), window,
          deep_only, static_cast<float>(scale));
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
