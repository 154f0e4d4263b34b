// Device side of ridgefill::int8_map_gemm: the GEMV path (any dtype, any wave size) and the format
// constants. Torch-free apart from c10's Half and BFloat16, so scripts/hip_check.sh can compile it
// for AMD targets without a ROCm build of torch; the host side (checks, path choice, registration)
// and the design notes are in int8_map_gemm.cu.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "common.cuh"

namespace ridgefill {
namespace {

constexpr int kGroup = 128;        // weights per scale along d_in (format constant)
constexpr int kGemvMaxRows = 8;    // M at or below this takes the GEMV path
constexpr int kGemvThreads = 256;  // 8 teams of 32 lanes = 8 output columns per block
constexpr int kGemvCols = kGemvThreads / kTeamSize;

// ---------------------------------------------------------------------------
// Loads of 16 consecutive x values as floats; p is 16-byte aligned (rows are
// a multiple of 128 elements and the launcher checks the base pointer).
template <typename scalar_t>
__device__ __forceinline__ void load16(const scalar_t* p, float (&out)[16]) {
  const uint4 a = reinterpret_cast<const uint4*>(p)[0];
  const uint4 b = reinterpret_cast<const uint4*>(p)[1];
  const scalar_t* ea = reinterpret_cast<const scalar_t*>(&a);
  const scalar_t* eb = reinterpret_cast<const scalar_t*>(&b);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<float>(ea[i]);
    out[8 + i] = static_cast<float>(eb[i]);
  }
}

template <>
__device__ __forceinline__ void load16<float>(const float* p, float (&out)[16]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 f = reinterpret_cast<const float4*>(p)[i];
    out[4 * i + 0] = f.x;
    out[4 * i + 1] = f.y;
    out[4 * i + 2] = f.z;
    out[4 * i + 3] = f.w;
  }
}

// grid (ceil(N / warps), ceil(M / 8)); warp w of block x owns column n.
template <typename scalar_t>
__global__ void __launch_bounds__(kGemvThreads)
    int8_gemv_kernel(scalar_t* __restrict__ y,                  // [M, N]
                     const scalar_t* __restrict__ x,            // [M, K]
                     const int8_t* __restrict__ qweight,        // [N, K]
                     const c10::BFloat16* __restrict__ scales,  // [N, K / 128]
                     const c10::BFloat16* __restrict__ bias,    // [N] or null
                     int M, int N, int K) {
  // 32-lane groups, not hardware warps, so that the host's grid (8 columns
  // per block) is right on wave64 too; reduce_sum_32 stays inside a group.
  const int lane = threadIdx.x % kTeamSize;
  const int n = blockIdx.x * kGemvCols + threadIdx.x / kTeamSize;
  if (n >= N) return;  // no barriers below; a group exits as a whole
  const int m0 = blockIdx.y * kGemvMaxRows;
  const int rows = min(kGemvMaxRows, M - m0);
  const int groups = K / kGroup;
  const int8_t* wrow = qweight + static_cast<int64_t>(n) * K;

  float acc[kGemvMaxRows];
#pragma unroll
  for (int m = 0; m < kGemvMaxRows; ++m) acc[m] = 0.0f;

  // 16 weights per lane per step: a warp streams 512 contiguous bytes.
  for (int k = lane * 16; k < K; k += kTeamSize * 16) {
    const uint4 packed = *reinterpret_cast<const uint4*>(wrow + k);
    const int8_t* qv = reinterpret_cast<const int8_t*>(&packed);
    float w[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) w[i] = static_cast<float>(qv[i]);
    // 16 divides 128: the lane's 16 weights share one scale.
    const float s = static_cast<float>(scales[static_cast<int64_t>(n) * groups + k / kGroup]);
#pragma unroll
    for (int m = 0; m < kGemvMaxRows; ++m) {
      if (m < rows) {
        float xv[16];
        load16<scalar_t>(x + static_cast<int64_t>(m0 + m) * K + k, xv);
        float part = 0.0f;
#pragma unroll
        for (int i = 0; i < 16; ++i) part += w[i] * xv[i];
        acc[m] += s * part;
      }
    }
  }
  const float b = bias != nullptr ? static_cast<float>(bias[n]) : 0.0f;
#pragma unroll
  for (int m = 0; m < kGemvMaxRows; ++m) {
    const float total = reduce_sum_32(acc[m]);
    if (lane == m && m < rows) {
      y[static_cast<int64_t>(m0 + m) * N + n] = static_cast<scalar_t>(total + b);
    }
  }
}

}  // namespace
}  // namespace ridgefill
