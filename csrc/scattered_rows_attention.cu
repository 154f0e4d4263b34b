// CUDA kernel for ridgefill::scattered_rows_attention (schema in bindings.cpp;
// contract and reference in ridgefill_runtime/ops/scattered_rows_attention.py).
//
// Query rows are an arbitrary subset of prompt rows (exact prefix rows, the
// tail, the probe rows) of several sequences. Row i belongs to sequence
// q_seq[i] and sits at position q_pos[i]; it sees that sequence's keys at
// positions 0..q_pos[i] (with a sliding window, window > 0: only
// first..q_pos[i], first = max(0, q_pos[i] - window + 1)) through the paged
// cache:
//   slot(b, j) = block_tables[b, j / block_size] * block_size + j % block_size.
// attend_rows (gqa_attention.cuh) walks keys 0..n_keys-1; the locator shifts
// them by `first`, so keys before the window are never read (a sliding-window
// cache may hold NaN there) and the shared block routine stays unchanged.
// Grid: (rows, kv heads, head chunks); see gqa_attention.cuh for the block.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <limits>
#include <tuple>

#include "common.cuh"
#include "dispatch.cuh"
#include "gqa_attention.cuh"

namespace ridgefill {
namespace {

template <typename scalar_t>
struct PagedLocator {
  const scalar_t* k_base;  // k_slab + kv_head * head_stride
  const scalar_t* v_base;
  const int32_t* table;    // this sequence's block table row
  int64_t k_slot_stride;
  int64_t v_slot_stride;
  int block_size;
  int first;               // position of the routine's key 0 (the window's start)

  __device__ __forceinline__ int64_t slot(int j) const {
    const int p = first + j;
    return static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
  }
  __device__ __forceinline__ const scalar_t* k(int j) const { return k_base + slot(j) * k_slot_stride; }
  __device__ __forceinline__ const scalar_t* v(int j) const { return v_base + slot(j) * v_slot_stride; }
};

template <typename scalar_t, int DPL, int MAXG, bool KEY_MASS>
__global__ void __launch_bounds__(kAttnThreads)
    scattered_rows_attention_kernel(scalar_t* __restrict__ out,          // [R, H, D]
                                    const scalar_t* __restrict__ q,      // [R, H, D]
                                    const int32_t* __restrict__ q_seq,   // [R]
                                    const int64_t* __restrict__ q_pos,   // [R]
                                    const scalar_t* __restrict__ k_slab, // [S, Hkv, D]
                                    const scalar_t* __restrict__ v_slab, // [S, Hkv, D]
                                    const int32_t* __restrict__ block_tables,  // [B, max_blocks]
                                    const int32_t* __restrict__ context_lens,  // [B]
                                    float* __restrict__ key_mass,        // [B, max_ctx]
                                    int num_heads, int head_dim, int group,
                                    int64_t k_slot_stride, int64_t k_head_stride,
                                    int64_t v_slot_stride, int64_t v_head_stride,
                                    int max_blocks, int block_size, int64_t max_ctx,
                                    float scale, int64_t window) {
  __shared__ AttnSmem<MAXG> smem;
  const int row = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int head0 = kv_head * group + blockIdx.z * MAXG;
  const int g_count = min(MAXG, group - static_cast<int>(blockIdx.z) * MAXG);
  const int b = q_seq[row];
  // Causal by original position; min() keeps a malformed q_pos (>= the
  // context length, rejected by the Python wrapper's reference path) from
  // reading past the sequence's blocks.
  const int64_t ctx = context_lens[b];
  const int64_t causal = q_pos[row] + 1;
  const int64_t visible = causal < ctx ? causal : ctx;
  // Sliding window: keys first..visible-1 (first <= q_pos, so n_keys >= 1 for a valid row; the clamp to
  // visible only keeps a malformed row's key_mass pointer inside the sequence).
  const int64_t start = window > 0 ? q_pos[row] - window + 1 : 0;
  const int64_t first = start <= 0 ? 0 : (start < visible ? start : (visible > 0 ? visible : 0));
  const int n_keys = visible > first ? static_cast<int>(visible - first) : 0;

  PagedLocator<scalar_t> loc{k_slab + kv_head * k_head_stride, v_slab + kv_head * v_head_stride,
                             block_tables + static_cast<int64_t>(b) * max_blocks,
                             k_slot_stride, v_slot_stride, block_size, static_cast<int>(first)};
  const int64_t row_off = (static_cast<int64_t>(row) * num_heads + head0) * head_dim;
  attend_rows<scalar_t, DPL, MAXG, KEY_MASS>(q + row_off, head_dim, out + row_off, head_dim, g_count,
                                             n_keys, head_dim, scale, loc,
                                             KEY_MASS ? key_mass + b * max_ctx + first : nullptr, smem);
}

std::tuple<at::Tensor, at::Tensor> scattered_rows_attention_cuda(
    const at::Tensor& q, const at::Tensor& q_seq, const at::Tensor& q_pos, const at::Tensor& k_slab,
    const at::Tensor& v_slab, const at::Tensor& block_tables, const at::Tensor& context_lens,
    int64_t block_size, double scale, bool return_key_mass, int64_t window) {
  constexpr const char* kName = "ridgefill::scattered_rows_attention: ";
  TORCH_CHECK(q.is_cuda(), kName, "q must be a CUDA tensor, got ", q.device());
  for (const at::Tensor* t : {&q_seq, &q_pos, &k_slab, &v_slab, &block_tables, &context_lens}) {
    TORCH_CHECK(t->device() == q.device(), kName, "all tensors must be on ", q.device(), ", got ",
                t->device());
  }
  TORCH_CHECK(q.dim() == 3, kName, "q must be [R, H, D], got ", q.sizes());
  TORCH_CHECK(k_slab.dim() == 3 && v_slab.sizes() == k_slab.sizes(), kName,
              "k_slab and v_slab must both be [S, Hkv, D], got ", k_slab.sizes(), " and ", v_slab.sizes());
  const int64_t rows = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = k_slab.size(1);
  TORCH_CHECK(k_slab.size(2) == head_dim, kName, "head dim of q (", head_dim, ") and k_slab (",
              k_slab.size(2), ") differ");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, kName, "H=", heads,
              " must be a multiple of Hkv=", kv_heads);
  TORCH_CHECK(head_dim >= 1 && head_dim <= kAttnMaxHeadDim, kName, "head dim must be in [1, ",
              kAttnMaxHeadDim, "], got ", head_dim);
  TORCH_CHECK(k_slab.scalar_type() == q.scalar_type() && v_slab.scalar_type() == q.scalar_type(), kName,
              "q, k_slab and v_slab must share a dtype");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, kName,
              "unsupported dtype ", dtype);
  TORCH_CHECK(q_seq.scalar_type() == at::kInt && q_seq.dim() == 1 && q_seq.size(0) == rows, kName,
              "q_seq must be int32 [R]");
  TORCH_CHECK(q_pos.scalar_type() == at::kLong && q_pos.dim() == 1 && q_pos.size(0) == rows, kName,
              "q_pos must be int64 [R]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2, kName,
              "block_tables must be int32 [B, max_blocks]");
  const int64_t batch = block_tables.size(0), max_blocks = block_tables.size(1);
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.dim() == 1 &&
                  context_lens.size(0) == batch,
              kName, "context_lens must be int32 [B]");
  TORCH_CHECK(block_size >= 1, kName, "block_size must be positive");
  TORCH_CHECK_VALUE(window >= 0, kName, "window must be >= 0 (0 = no sliding window), got ", window);
  // The slabs are the whole KV cache: never copy them silently.
  TORCH_CHECK(k_slab.stride(2) == 1 && v_slab.stride(2) == 1, kName,
              "k_slab/v_slab need a contiguous last dim");
  const int64_t max_ctx = max_blocks * block_size;
  TORCH_CHECK(max_ctx <= std::numeric_limits<int32_t>::max() && rows <= std::numeric_limits<int32_t>::max(),
              kName, "too many keys or rows for one launch");

  const c10::cuda::CUDAGuard device_guard(q.device());
  at::Tensor out = at::empty({rows, heads, head_dim}, q.options());
  at::Tensor key_mass = return_key_mass ? at::zeros({batch, max_ctx}, q.options().dtype(at::kFloat))
                                        : at::empty({0}, q.options().dtype(at::kFloat));
  if (rows == 0 || heads == 0) return {out, key_mass};

  const at::Tensor qc = q.contiguous();
  const at::Tensor seq_c = q_seq.contiguous();
  const at::Tensor pos_c = q_pos.contiguous();
  const at::Tensor tables_c = block_tables.contiguous();
  const at::Tensor lens_c = context_lens.contiguous();
  const int group = static_cast<int>(heads / kv_heads);
  const auto stream = c10::cuda::getCurrentCUDAStream();

  RIDGEFILL_DISPATCH_FLOAT_TYPES(dtype, "scattered_rows_attention", [&] {
    RIDGEFILL_DISPATCH_HEAD_DIM(head_dim, [&] {
      const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(kv_heads),
                      static_cast<unsigned>(ceil_div(group, kMaxG)));
      auto launch = [&](auto kernel) {
        kernel<<<grid, kAttnThreads, 0, stream>>>(
            out.data_ptr<scalar_t>(), qc.const_data_ptr<scalar_t>(), seq_c.const_data_ptr<int32_t>(),
            pos_c.const_data_ptr<int64_t>(), k_slab.const_data_ptr<scalar_t>(),
            v_slab.const_data_ptr<scalar_t>(), tables_c.const_data_ptr<int32_t>(),
            lens_c.const_data_ptr<int32_t>(), return_key_mass ? key_mass.data_ptr<float>() : nullptr,
            static_cast<int>(heads), static_cast<int>(head_dim), group, k_slab.stride(0), k_slab.stride(1),
            v_slab.stride(0), v_slab.stride(1), static_cast<int>(max_blocks), static_cast<int>(block_size),
            max_ctx, static_cast<float>(scale), window);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      if (return_key_mass) {
        launch(scattered_rows_attention_kernel<scalar_t, kDpl, kMaxG, true>);
      } else {
        launch(scattered_rows_attention_kernel<scalar_t, kDpl, kMaxG, false>);
      }
    });
  });
  return {out, key_mass};
}

}  // namespace
}  // namespace ridgefill

TORCH_LIBRARY_IMPL(ridgefill, CUDA, m) {
  m.impl("scattered_rows_attention", &ridgefill::scattered_rows_attention_cuda);
}
