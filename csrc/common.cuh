// Small device helpers shared by the ridgefill kernels.
//
// Kept free of inline PTX so that torch's hipify (run by CUDAExtension on a
// ROCm build of torch) can translate the kernels to HIP unchanged.
#pragma once

#include <cstdint>

namespace ridgefill {

// Threads per warp/wavefront. NVIDIA is always 32. On AMD, CDNA (gfx90a, gfx942) runs wave64,
// while RDNA (gfx10xx-gfx12xx, e.g. gfx1201) compiles to wave32 by default and to wave64 with
// -mwavefrontsize64: the compiler's own macro says which. It is only defined in the device pass,
// so host code must not size anything by this constant; launch configs use multiples of 64
// threads, which are whole warps on every target.
#if defined(USE_ROCM) && defined(__AMDGCN_WAVEFRONT_SIZE__)
constexpr int kWarpSize = __AMDGCN_WAVEFRONT_SIZE__;
#elif defined(USE_ROCM) && defined(__AMDGCN_WAVEFRONT_SIZE)
constexpr int kWarpSize = __AMDGCN_WAVEFRONT_SIZE;
#elif defined(USE_ROCM) && defined(__GFX9__)
constexpr int kWarpSize = 64;
#else
constexpr int kWarpSize = 32;
#endif
#if defined(__AMDGCN_WAVEFRONT_SIZE__)
static_assert(kWarpSize == __AMDGCN_WAVEFRONT_SIZE__, "kWarpSize must be the target's wavefront size");
#endif

// Lanes per team: a 32-lane group, the whole warp on wave32 and half a wavefront on wave64. Kernels
// that give each task to one team (reduce_sum_32 below) let the host size grids without knowing
// the warp size.
constexpr int kTeamSize = 32;

// Largest block we launch; a multiple of 64 so it is whole warps everywhere.
constexpr int kMaxBlockThreads = 1024;

template <typename T>
__device__ __forceinline__ T shfl_xor(T value, int lane_mask) {
#if defined(USE_ROCM)
  return __shfl_xor(value, lane_mask);
#else
  return __shfl_xor_sync(0xffffffffu, value, lane_mask);  // wave-size: NVIDIA only, 32 lanes
#endif
}

__device__ __forceinline__ float warp_reduce_sum(float value) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value += shfl_xor(value, offset);
  }
  return value;
}

// Sum of `value` over the whole block; every thread gets the result.
// `scratch` must hold kMaxBlockThreads / kWarpSize floats. blockDim.x must be a
// multiple of kWarpSize (so no warp is partial and the shuffles are defined).
__device__ __forceinline__ float block_reduce_sum(float value, float* scratch) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;

  value = warp_reduce_sum(value);
  if (lane == 0) {
    scratch[warp] = value;
  }
  __syncthreads();
  // num_warps <= 1024 / 32 = 32 <= kWarpSize, so one warp can finish the sum.
  value = (static_cast<int>(threadIdx.x) < num_warps) ? scratch[threadIdx.x] : 0.0f;
  if (warp == 0) {
    value = warp_reduce_sum(value);
    if (lane == 0) {
      scratch[0] = value;
    }
  }
  __syncthreads();
  const float total = scratch[0];
  // A caller may reuse `scratch` right after returning.
  __syncthreads();
  return total;
}

__device__ __forceinline__ float warp_reduce_max(float value) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value = fmaxf(value, shfl_xor(value, offset));
  }
  return value;
}

// Sum over aligned groups of 32 lanes: the whole warp on wave32, each half
// of a wavefront on wave64. For kernels that assign one 32-lane group per
// task so that the host can size grids without knowing the warp size.
__device__ __forceinline__ float reduce_sum_32(float value) {
#pragma unroll
  for (int offset = kTeamSize / 2; offset > 0; offset /= 2) {
    value += shfl_xor(value, offset);
  }
  return value;
}

// Integer ceil-division for launch sizes (host and device).
template <typename T>
__host__ __device__ constexpr T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

}  // namespace ridgefill
