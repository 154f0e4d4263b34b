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
//
// Split-KV (flash-decoding). A decode step of a few long sequences gives the
// grid above only rows * Hkv * head-chunks blocks (B=1, Hkv=3: 3 blocks for
// 132 SMs), each walking the whole context: the GPU idles. When the grid has
// fewer than kSplitBlocksPerSm blocks per SM, each row's keys first..q_pos are
// cut into chunks of `chunk` keys, one block per (row, chunk, KV head, head
// chunk). The host never syncs (the per-row key counts live on the device):
// the number of chunks comes from the most keys any row can see, max_ctx =
// max_blocks * block_size (or the window), and each block works out on the
// device whether its chunk holds keys of its row; chunks past a row's last key
// exit at once. A row whose keys fit in one chunk is finished by its chunk 0,
// which writes the output directly. A longer row's chunks leave, per head,
// the running max m_c, the sum of exp l_c and the unnormalised output acc_c
// (fp32) in a workspace from the caching allocator (so the op stays
// capturable in a CUDA graph); a second kernel combines them:
//   m = max m_c,  out = sum_c exp(m_c - m) acc_c / sum_c exp(m_c - m) l_c.
// key_mass (return_key_mass) never splits: its second pass needs each row's
// final softmax statistics inside the block, and the probe that asks for it
// runs over many rows anyway. The policy counts blocks, not keys (those are
// on the device): a launch with enough rows is never split, even if one of
// its rows is much longer than the others.
// Test knob RIDGEFILL_CUDA_ATTN_SPLIT (read once per process): 0 never splits,
// 1 splits every row longer than kMinSplitKeys (chunks of kMinSplitKeys keys),
// unset or anything else = the heuristic above.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <tuple>

#include "common.cuh"
#include "scattered_rows_attention_kernels.cuh"
#include "dispatch.cuh"
#include "gqa_attention.cuh"

namespace ridgefill {
namespace {

// RIDGEFILL_CUDA_ATTN_SPLIT, read once: 0 never, 1 always (rows longer than kMinSplitKeys), -1 heuristic.
int split_mode() {
  static const int mode = [] {
    const char* env = std::getenv("RIDGEFILL_CUDA_ATTN_SPLIT");
    if (env != nullptr && env[0] == '0' && env[1] == '\0') return 0;
    if (env != nullptr && env[0] == '1' && env[1] == '\0') return 1;
    return -1;
  }();
  return mode;
}

// Keys per chunk for this launch, or 0 for no split. span: the most keys any
// row can see (max_ctx, or the window when shorter); base_blocks: the unsplit grid.
int64_t split_chunk_keys(int64_t span, int64_t rows, int64_t base_blocks, bool return_key_mass) {
  const int mode = split_mode();
  if (mode == 0 || return_key_mass || span <= kMinSplitKeys) return 0;
  int64_t chunk = kMinSplitKeys;
  if (mode != 1) {
    const int64_t target = static_cast<int64_t>(kSplitBlocksPerSm) *
                           at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    if (base_blocks >= target) return 0;  // enough blocks already (prefill, large decode batches)
    const int64_t n = ceil_div(target, base_blocks);  // chunks per full-length row to reach the target
    chunk = std::max<int64_t>(kMinSplitKeys, ceil_div(ceil_div(span, n), int64_t{kSplitKeysAlign}) * kSplitKeysAlign);
  }
  chunk = std::max(chunk, ceil_div(span, int64_t{kMaxSplits}));
  const int64_t n_splits = ceil_div(span, chunk);
  if (n_splits <= 1 || rows * n_splits > std::numeric_limits<int32_t>::max()) return 0;
  return chunk;
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
      const int64_t head_chunks = ceil_div(static_cast<int64_t>(group), static_cast<int64_t>(kMaxG));
      const int64_t span = window > 0 && window < max_ctx ? window : max_ctx;
      const int64_t chunk = split_chunk_keys(span, rows, rows * kv_heads * head_chunks, return_key_mass);
      const int64_t n_splits = chunk > 0 ? ceil_div(span, chunk) : 1;
      // Split partials (acc, then m, then l); from the caching allocator, so graph capture keeps working.
      at::Tensor ws = chunk > 0 ? at::empty({rows * heads * n_splits * (head_dim + 2)}, q.options().dtype(at::kFloat))
                                : at::empty({0}, q.options().dtype(at::kFloat));
      float* ws_acc = chunk > 0 ? ws.data_ptr<float>() : nullptr;
      float* ws_m = chunk > 0 ? ws_acc + rows * heads * n_splits * head_dim : nullptr;
      float* ws_l = chunk > 0 ? ws_m + rows * heads * n_splits : nullptr;
      const dim3 grid(static_cast<unsigned>(rows * n_splits), static_cast<unsigned>(kv_heads),
                      static_cast<unsigned>(head_chunks));
      auto launch = [&](auto kernel) {
        kernel<<<grid, kAttnThreads, 0, stream>>>(
            out.data_ptr<scalar_t>(), qc.const_data_ptr<scalar_t>(), seq_c.const_data_ptr<int32_t>(),
            pos_c.const_data_ptr<int64_t>(), k_slab.const_data_ptr<scalar_t>(),
            v_slab.const_data_ptr<scalar_t>(), tables_c.const_data_ptr<int32_t>(),
            lens_c.const_data_ptr<int32_t>(), return_key_mass ? key_mass.data_ptr<float>() : nullptr,
            static_cast<int>(heads), static_cast<int>(head_dim), group, k_slab.stride(0), k_slab.stride(1),
            v_slab.stride(0), v_slab.stride(1), static_cast<int>(max_blocks), static_cast<int>(block_size),
            max_ctx, static_cast<float>(scale), window, ws_acc, ws_m, ws_l, static_cast<int>(n_splits),
            static_cast<int>(chunk));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      if (return_key_mass) {
        launch(scattered_rows_attention_kernel<scalar_t, kDpl, kMaxG, true, false>);
      } else if (chunk == 0) {
        launch(scattered_rows_attention_kernel<scalar_t, kDpl, kMaxG, false, false>);
      } else {
        launch(scattered_rows_attention_kernel<scalar_t, kDpl, kMaxG, false, true>);
        const dim3 combine_grid(static_cast<unsigned>(rows), static_cast<unsigned>(heads));
        scattered_rows_combine_kernel<scalar_t><<<combine_grid, kCombineThreads, 0, stream>>>(
            out.data_ptr<scalar_t>(), ws_acc, ws_m, ws_l, seq_c.const_data_ptr<int32_t>(),
            pos_c.const_data_ptr<int64_t>(), lens_c.const_data_ptr<int32_t>(), static_cast<int>(heads),
            static_cast<int>(head_dim), static_cast<int>(n_splits), static_cast<int>(chunk), window);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
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
