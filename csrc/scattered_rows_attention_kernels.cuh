// Device side of ridgefill::scattered_rows_attention: the locator, the split-KV sink, the kernel
// and the combine. Torch-free apart from c10's Half and BFloat16, so scripts/hip_check.sh can
// compile it for AMD targets without a ROCm build of torch; the host side (checks, allocation,
// dtype dispatch, registration) and the design notes are in scattered_rows_attention.cu.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>

#include "common.cuh"
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

constexpr int kMinSplitKeys = 256;      // never cut a row into chunks shorter than this
constexpr int kSplitKeysAlign = 64;     // chunk lengths are a multiple of this
constexpr int kMaxSplits = 1024;        // chunks per row (the combine's shared weights)
constexpr int kSplitBlocksPerSm = 4;    // split while the grid has fewer blocks than this per SM
constexpr int kCombineThreads = 128;    // a multiple of 64: whole warps on every target

// Keys row `row` sees: first .. first + n_keys - 1. Shared by both kernels of
// the split so that they agree on each row's chunks.
struct RowKeys {
  int64_t first;
  int n_keys;
};

__device__ __forceinline__ RowKeys row_keys(int row, const int32_t* __restrict__ q_seq,
                                            const int64_t* __restrict__ q_pos,
                                            const int32_t* __restrict__ context_lens, int64_t window) {
  // Causal by original position; min() keeps a malformed q_pos (>= the
  // context length, rejected by the Python wrapper's reference path) from
  // reading past the sequence's blocks.
  const int64_t ctx = context_lens[q_seq[row]];
  const int64_t causal = q_pos[row] + 1;
  const int64_t visible = causal < ctx ? causal : ctx;
  // Sliding window: keys first..visible-1 (first <= q_pos, so n_keys >= 1 for a valid row; the clamp to
  // visible only keeps a malformed row's key_mass pointer inside the sequence).
  const int64_t start = window > 0 ? q_pos[row] - window + 1 : 0;
  const int64_t first = start <= 0 ? 0 : (start < visible ? start : (visible > 0 ? visible : 0));
  return {first, visible > first ? static_cast<int>(visible - first) : 0};
}

// attend_rows sink of a split row. direct (the row fits in one chunk): the
// normalised output, as OutRows. Otherwise this chunk's partials, workspace
// layout acc [R, H, n_splits, D], m and l [R, H, n_splits]; the pointers are at
// (row, head0, split) and heads are n_splits * D (n_splits) apart.
template <typename scalar_t>
struct SplitSink {
  scalar_t* out;
  int64_t out_head_stride;
  float* acc;
  float* m;
  float* l;
  int n_splits;
  int head_dim;
  bool direct;  // block-uniform

  __device__ __forceinline__ void value(int g, int d, float o, float inv_l) const {
    if (direct) {
      out[g * out_head_stride + d] = static_cast<scalar_t>(o * inv_l);
    } else {
      acc[(static_cast<int64_t>(g) * n_splits) * head_dim + d] = o;
    }
  }
  __device__ __forceinline__ void stats(int g, float m_g, float l_g) const {
    if (!direct) {
      m[g * n_splits] = m_g;
      l[g * n_splits] = l_g;
    }
  }
};

// SPLIT: blockIdx.x = row * n_splits + chunk, keys first + chunk * chunk_keys ..
// (the row's part of them); partials go to ws_acc/ws_m/ws_l. Never with KEY_MASS.
template <typename scalar_t, int DPL, int MAXG, bool KEY_MASS, bool SPLIT>
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
                                    float scale, int64_t window,
                                    float* __restrict__ ws_acc,  // SPLIT: [R, H, n_splits, D]
                                    float* __restrict__ ws_m,    // SPLIT: [R, H, n_splits]
                                    float* __restrict__ ws_l,    // SPLIT: [R, H, n_splits]
                                    int n_splits, int chunk_keys) {
  static_assert(!(SPLIT && KEY_MASS), "key_mass never splits");
  __shared__ AttnSmem<MAXG> smem;
  const int row = SPLIT ? static_cast<int>(blockIdx.x) / n_splits : static_cast<int>(blockIdx.x);
  const int kv_head = blockIdx.y;
  const int head0 = kv_head * group + blockIdx.z * MAXG;
  const int g_count = min(MAXG, group - static_cast<int>(blockIdx.z) * MAXG);
  const int b = q_seq[row];
  const RowKeys keys = row_keys(row, q_seq, q_pos, context_lens, window);

  PagedLocator<scalar_t> loc{k_slab + kv_head * k_head_stride, v_slab + kv_head * v_head_stride,
                             block_tables + static_cast<int64_t>(b) * max_blocks,
                             k_slot_stride, v_slot_stride, block_size, static_cast<int>(keys.first)};
  const int64_t row_off = (static_cast<int64_t>(row) * num_heads + head0) * head_dim;
  if constexpr (SPLIT) {
    const int split = static_cast<int>(blockIdx.x) % n_splits;
    const int n_chunks = ceil_div(keys.n_keys, chunk_keys);
    // Past the row's last key (block-uniform, before any barrier). Chunk 0 of
    // a row without keys (malformed) still runs and writes zeros, as unsplit.
    if (split > 0 && split >= n_chunks) return;
    const int j0 = split * chunk_keys;
    loc.first += j0;
    const int64_t ws_off = (static_cast<int64_t>(row) * num_heads + head0) * n_splits + split;
    const SplitSink<scalar_t> sink{out + row_off, head_dim,  ws_acc + ws_off * head_dim, ws_m + ws_off,
                                   ws_l + ws_off,  n_splits, head_dim,                   n_chunks <= 1};
    attend_rows_into<scalar_t, DPL, MAXG, false>(q + row_off, head_dim, sink, g_count,
                                                 min(chunk_keys, keys.n_keys - j0), head_dim, scale, loc,
                                                 nullptr, smem);
  } else {
    attend_rows<scalar_t, DPL, MAXG, KEY_MASS>(q + row_off, head_dim, out + row_off, head_dim, g_count,
                                               keys.n_keys, head_dim, scale, loc,
                                               KEY_MASS ? key_mass + b * max_ctx + keys.first : nullptr, smem);
  }
}

// Max of `value` over the block; every thread gets it (as block_reduce_sum in common.cuh).
__device__ __forceinline__ float block_reduce_max(float value, float* scratch) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  value = warp_reduce_max(value);
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  value = (static_cast<int>(threadIdx.x) < num_warps) ? scratch[threadIdx.x] : -INFINITY;
  if (warp == 0) {
    value = warp_reduce_max(value);
    if (lane == 0) scratch[0] = value;
  }
  __syncthreads();
  const float total = scratch[0];
  __syncthreads();
  return total;
}

// One block per (row, head): merges the row's chunks with log-sum-exp weights.
// Rows with at most one chunk were written by the first kernel.
template <typename scalar_t>
__global__ void __launch_bounds__(kCombineThreads)
    scattered_rows_combine_kernel(scalar_t* __restrict__ out,             // [R, H, D]
                                  const float* __restrict__ ws_acc,       // [R, H, n_splits, D]
                                  const float* __restrict__ ws_m,         // [R, H, n_splits]
                                  const float* __restrict__ ws_l,         // [R, H, n_splits]
                                  const int32_t* __restrict__ q_seq, const int64_t* __restrict__ q_pos,
                                  const int32_t* __restrict__ context_lens, int num_heads, int head_dim,
                                  int n_splits, int chunk_keys, int64_t window) {
  __shared__ float weight[kMaxSplits];
  __shared__ float scratch[kMaxBlockThreads / kWarpSize];
  const int row = blockIdx.x;
  const int head = blockIdx.y;
  const int n_chunks = ceil_div(row_keys(row, q_seq, q_pos, context_lens, window).n_keys, chunk_keys);
  if (n_chunks <= 1) return;  // block-uniform
  const int64_t rh = static_cast<int64_t>(row) * num_heads + head;
  const float* m = ws_m + rh * n_splits;
  const float* l = ws_l + rh * n_splits;
  const float* acc = ws_acc + rh * n_splits * head_dim;
  // Every chunk below n_chunks holds at least one key, so its m is finite.
  float big_m = -INFINITY;
  for (int c = threadIdx.x; c < n_chunks; c += blockDim.x) big_m = fmaxf(big_m, m[c]);
  big_m = block_reduce_max(big_m, scratch);
  float big_l = 0.0f;
  for (int c = threadIdx.x; c < n_chunks; c += blockDim.x) {
    const float w = expf(m[c] - big_m);
    weight[c] = w;
    big_l += l[c] * w;
  }
  big_l = block_reduce_sum(big_l, scratch);  // its barriers also publish weight[]
  const float inv_l = big_l > 0.0f ? 1.0f / big_l : 0.0f;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float o = 0.0f;
    for (int c = 0; c < n_chunks; ++c) o += weight[c] * acc[static_cast<int64_t>(c) * head_dim + d];
    out[rh * head_dim + d] = static_cast<scalar_t>(o * inv_l);
  }
}

}  // namespace
}  // namespace ridgefill
