// Device side of ridgefill::rms_norm: the kernel. Torch-free apart from c10's Half and BFloat16, so
// scripts/hip_check.sh can compile it for AMD targets without a ROCm build of torch; the host side
// (checks, allocation, dtype dispatch, registration) and the design notes are in rms_norm.cu.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "common.cuh"

namespace ridgefill {
namespace {

// One block per row. Two passes over the row: the second re-reads x, which
// is served from L1/L2 for the hidden sizes we care about (<= 16k), so no
// shared-memory row cache is needed.
template <typename scalar_t>
__global__ void rms_norm_kernel(scalar_t* __restrict__ out,
                                const scalar_t* __restrict__ x,
                                const scalar_t* __restrict__ weight,
                                int64_t cols, int64_t x_row_stride,
                                float eps) {
  __shared__ float scratch[kMaxBlockThreads / kWarpSize];
  const int64_t row = blockIdx.x;
  const scalar_t* x_row = x + row * x_row_stride;
  scalar_t* out_row = out + row * cols;

  float sum_sq = 0.0f;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
    const float v = static_cast<float>(x_row[i]);
    sum_sq += v * v;
  }
  const float total = block_reduce_sum(sum_sq, scratch);
  // sqrtf and '/' are correctly rounded without --use_fast_math, unlike
  // rsqrtf (2 ulp), which keeps us closest to torch's fp32 reference.
  const float inv_rms = 1.0f / sqrtf(total / static_cast<float>(cols) + eps);

  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
    const scalar_t normed =
        static_cast<scalar_t>(static_cast<float>(x_row[i]) * inv_rms);
    out_row[i] = static_cast<scalar_t>(static_cast<float>(normed) *
                                       static_cast<float>(weight[i]));
  }
}

}  // namespace
}  // namespace ridgefill
