// Device side of ridgefill::ripe_attention: the locator and the kernel. Torch-free apart from c10's
// Half and BFloat16, so scripts/hip_check.sh can compile it for AMD targets without a ROCm build of
// torch; the host side (checks, allocation, dtype dispatch, registration) and the design notes are
// in ripe_attention.cu.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "common.cuh"
#include "gqa_attention.cuh"

namespace ridgefill {
namespace {

// Strides (in elements) of one [B, N, Hkv, D] operand; the last dim is contiguous.
struct PlaneStrides {
  int64_t b, n, h;
};

template <typename scalar_t>
struct RipeLocator {
  // Each base already points at [b, 0, kv_head, 0] of its operand. The
  // kernel keeps one copy in shared memory (the fields are block-uniform):
  // six plane pointers held in registers next to the query and accumulator
  // arrays pushed the D = 256 variant past 128 registers (half the occupancy);
  // from shared memory every variant stays <= 128 with no spills (sm_90).
  const scalar_t* block_k;
  const scalar_t* block_v;
  const scalar_t* deep_k;
  const scalar_t* deep_v;
  const scalar_t* ring_k;
  const scalar_t* ring_v;
  int block_k_stride, block_v_stride;  // per block token
  int deep_k_stride, deep_v_stride;    // per position
  int ring_k_stride, ring_v_stride;    // per slot
  int t0;          // first block position (= cached positions before the block)
  int near_begin;  // max(0, t - W): cached j >= near_begin has t - j <= W (ring)
  int capacity;    // ring slots C (>= 1)

  // j's source is warp-uniform: one warp handles one key at a time.
  __device__ __forceinline__ const scalar_t* k(int j) const {
    if (j >= t0) return block_k + static_cast<int64_t>(j - t0) * block_k_stride;
    if (j >= near_begin) return ring_k + static_cast<int64_t>(j % capacity) * ring_k_stride;
    return deep_k + static_cast<int64_t>(j) * deep_k_stride;
  }
  __device__ __forceinline__ const scalar_t* v(int j) const {
    if (j >= t0) return block_v + static_cast<int64_t>(j - t0) * block_v_stride;
    if (j >= near_begin) return ring_v + static_cast<int64_t>(j % capacity) * ring_v_stride;
    return deep_v + static_cast<int64_t>(j) * deep_v_stride;
  }
};

template <typename scalar_t, int DPL, int MAXG>
__global__ void __launch_bounds__(kAttnThreads)
    ripe_attention_kernel(scalar_t* __restrict__ out,            // [B, Tq, H, D], contiguous
                          const scalar_t* __restrict__ q,        // [B, Tq, H, D], contiguous
                          const scalar_t* __restrict__ block_k,  // [B, Tq, Hkv, D]
                          const scalar_t* __restrict__ block_v,
                          const scalar_t* __restrict__ deep_k,   // [B, T, Hkv, D]
                          const scalar_t* __restrict__ deep_v,
                          const scalar_t* __restrict__ ring_k,   // [B, C, Hkv, D]
                          const scalar_t* __restrict__ ring_v,
                          const int32_t* __restrict__ cache_lens,  // [B]
                          int block_len, int num_heads, int head_dim, int group, int deep_len,
                          PlaneStrides bk, PlaneStrides bv, PlaneStrides dk, PlaneStrides dv,
                          PlaneStrides rk, PlaneStrides rv, int capacity, int64_t window, float scale) {
  __shared__ AttnSmem<MAXG> smem;
  const int row = blockIdx.x;  // b * Tq + a
  const int b = row / block_len;
  const int a = row % block_len;
  const int kv_head = blockIdx.y;
  const int head0 = kv_head * group + blockIdx.z * MAXG;
  const int g_count = min(MAXG, group - static_cast<int>(blockIdx.z) * MAXG);
  const int t0 = cache_lens[b];
  const int64_t row_off = (static_cast<int64_t>(row) * num_heads + head0) * head_dim;

  if (t0 < 0 || t0 > deep_len) {
    // cache_lens out of range for deep (the host does not sync to check it):
    // a loud NaN instead of an out-of-bounds read. Block-uniform, before any
    // barrier, so the early return is safe.
    for (int i = threadIdx.x; i < g_count * head_dim; i += blockDim.x) {
      out[row_off + i] = static_cast<scalar_t>(__int_as_float(0x7fc00000));  // quiet NaN
    }
    return;
  }
  const int t = t0 + a;  // < T + Tq <= INT32_MAX (host check)

  __shared__ RipeLocator<scalar_t> loc;
  if (threadIdx.x == 0) {
    loc.block_k = block_k + b * bk.b + kv_head * bk.h;
    loc.block_v = block_v + b * bv.b + kv_head * bv.h;
    loc.deep_k = deep_k + b * dk.b + kv_head * dk.h;
    loc.deep_v = deep_v + b * dv.b + kv_head * dv.h;
    loc.ring_k = ring_k + b * rk.b + kv_head * rk.h;
    loc.ring_v = ring_v + b * rv.b + kv_head * rv.h;
    loc.block_k_stride = static_cast<int>(bk.n);
    loc.block_v_stride = static_cast<int>(bv.n);
    loc.deep_k_stride = static_cast<int>(dk.n);
    loc.deep_v_stride = static_cast<int>(dv.n);
    loc.ring_k_stride = static_cast<int>(rk.n);
    loc.ring_v_stride = static_cast<int>(rv.n);
    loc.t0 = t0;
    loc.near_begin = static_cast<int>(window >= t ? 0 : t - window);
    loc.capacity = capacity;
  }
  __syncthreads();

  attend_rows<scalar_t, DPL, MAXG, false>(q + row_off, head_dim, out + row_off, head_dim, g_count,
                                          t + 1, head_dim, scale, loc, nullptr, smem);
}

}  // namespace
}  // namespace ridgefill
