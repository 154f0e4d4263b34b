// Device side of ridgefill::int8_map_gemm: the tensor-core (WMMA) GEMM path, 16-bit x only.
// Torch-free apart from c10's Half and BFloat16, so scripts/hip_check.sh can compile it for AMD
// targets without a ROCm build of torch; the host side (checks, path choice, registration) and the
// design notes are in int8_map_gemm.cu.
#pragma once

// Apart from the GEMV header because it needs nvcuda::wmma or rocWMMA, which the HIP check may
// not have.
#if defined(USE_ROCM)
#include <hip/hip_bf16.h>
#include <hip/hip_fp16.h>
#include <rocwmma/rocwmma.hpp>
namespace RF_WMMA = rocwmma;
using rf_bf16 = rocwmma::bfloat16_t;
using rf_half = rocwmma::float16_t;
__device__ __forceinline__ void from_float(float f, rf_bf16& out) { out = static_cast<rf_bf16>(f); }
__device__ __forceinline__ void from_float(float f, rf_half& out) { out = static_cast<rf_half>(f); }
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
namespace RF_WMMA = nvcuda::wmma;
using rf_bf16 = __nv_bfloat16;
using rf_half = __half;
// Explicit intrinsics: torch builds with __CUDA_NO_BFLOAT16_CONVERSIONS__ and
// __CUDA_NO_HALF_CONVERSIONS__, which remove the implicit float constructors.
__device__ __forceinline__ void from_float(float f, rf_bf16& out) { out = __float2bfloat16_rn(f); }
__device__ __forceinline__ void from_float(float f, rf_half& out) { out = __float2half_rn(f); }
#endif

#include "int8_map_gemm_kernels.cuh"

namespace ridgefill {
namespace {

// ---------------------------------------------------------------------------
// Tensor-core path.
constexpr int kBM = 64, kBN = 128, kBK = 32;
constexpr int kPad = 8;  // keeps rows 16-byte aligned and staggers banks
constexpr int kLds = kBK + kPad;  // smem row length (elements) of A and B tiles
constexpr int kLdc = kBN + 4;     // fp32 epilogue tile row length
constexpr int kGemmThreads = 256;  // 8 warps: 2 (M) x 4 (N), 32x32 each
constexpr int kTileBytesA = 2 * kBM * kLds * 2;  // double buffered, 2-byte elements
constexpr int kTileBytesB = 2 * kBN * kLds * 2;
constexpr int kTileBytesC = kBM * kLdc * 4;
constexpr int kGemmSmemBytes =
    (kTileBytesA + kTileBytesB) > kTileBytesC ? (kTileBytesA + kTileBytesB) : kTileBytesC;
static_assert(kGemmSmemBytes <= 48 * 1024, "static shared memory limit");

template <typename scalar_t> struct WmmaType;
template <> struct WmmaType<c10::BFloat16> { using type = rf_bf16; };
template <> struct WmmaType<c10::Half> { using type = rf_half; };

// One 64 x 128 output tile per block of 256 threads: 8 warps of 32 lanes, 2 (M) x 4 (N).
template <typename scalar_t>
__device__ __forceinline__ void int8_gemm_wmma_tile(scalar_t* __restrict__ y,                  // [M, N]
                                                    const scalar_t* __restrict__ x,            // [M, K]
                                                    const int8_t* __restrict__ qweight,        // [N, K]
                                                    const c10::BFloat16* __restrict__ scales,  // [N, K / 128]
                                                    const c10::BFloat16* __restrict__ bias,    // [N] or null
                                                    int M, int N, int K) {
  using T = typename WmmaType<scalar_t>::type;
  __shared__ __align__(128) unsigned char smem_raw[kGemmSmemBytes];
  T* a_s = reinterpret_cast<T*>(smem_raw);                 // [2][kBM][kLds]
  T* b_s = reinterpret_cast<T*>(smem_raw + kTileBytesA);   // [2][kBN][kLds], b_s[n][k]
  float* c_s = reinterpret_cast<float*>(smem_raw);         // [kBM][kLdc], after the K loop

  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;  // 32 lanes: the kernel below compiles this for wave32 only
  const int warp_m = warp / 4, warp_n = warp % 4;
  const int m0 = blockIdx.y * kBM, n0 = blockIdx.x * kBN;
  const int groups = K / kGroup;

  // Each thread moves 8 x values (16 B) and 16 weights (16 B) per K tile.
  const int a_row = tid / 4, a_col = (tid % 4) * 8;
  const int b_row = tid / 2, b_col = (tid % 2) * 16;
  const bool a_ok = m0 + a_row < M;
  const bool b_ok = n0 + b_row < N;
  const scalar_t* a_src = x + static_cast<int64_t>(m0 + a_row) * K + a_col;
  const int8_t* b_src = qweight + static_cast<int64_t>(n0 + b_row) * K + b_col;
  const c10::BFloat16* s_src = scales + static_cast<int64_t>(n0 + b_row) * groups;

  uint4 a_reg = make_uint4(0, 0, 0, 0), b_reg = make_uint4(0, 0, 0, 0);
  float s_reg = 0.0f;
  auto load_tile = [&](int k0) {
    if (a_ok) a_reg = *reinterpret_cast<const uint4*>(a_src + k0);
    if (b_ok) {
      b_reg = *reinterpret_cast<const uint4*>(b_src + k0);
      s_reg = static_cast<float>(s_src[k0 / kGroup]);
    }
  };
  auto store_tile = [&](int buf) {
    // Rows past M / N are zeros (registers start zeroed and are never
    // loaded for them), so partial tiles need no masking in the MMAs.
    *reinterpret_cast<uint4*>(a_s + (buf * kBM + a_row) * kLds + a_col) = a_reg;
    const int8_t* qv = reinterpret_cast<const int8_t*>(&b_reg);
    alignas(16) T w[16];  // moved to shared memory as two 16-byte stores
#pragma unroll
    for (int i = 0; i < 16; ++i) from_float(static_cast<float>(qv[i]) * s_reg, w[i]);
    uint4* dst = reinterpret_cast<uint4*>(b_s + (buf * kBN + b_row) * kLds + b_col);
    dst[0] = reinterpret_cast<const uint4*>(w)[0];
    dst[1] = reinterpret_cast<const uint4*>(w)[1];
  };

  RF_WMMA::fragment<RF_WMMA::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) RF_WMMA::fill_fragment(acc[i][j], 0.0f);

  const int k_tiles = K / kBK;
  load_tile(0);
  store_tile(0);
  __syncthreads();
  for (int kt = 0; kt < k_tiles; ++kt) {
    const int buf = kt & 1;
    if (kt + 1 < k_tiles) load_tile((kt + 1) * kBK);  // in flight during the MMAs
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      RF_WMMA::fragment<RF_WMMA::matrix_a, 16, 16, 16, T, RF_WMMA::row_major> fa[2];
      RF_WMMA::fragment<RF_WMMA::matrix_b, 16, 16, 16, T, RF_WMMA::col_major> fb[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        RF_WMMA::load_matrix_sync(fa[i], a_s + (buf * kBM + warp_m * 32 + i * 16) * kLds + kk, kLds);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        // B(k, n) = W[n, k] sits at b_s[n][k]: a column-major k x n tile.
        RF_WMMA::load_matrix_sync(fb[j], b_s + (buf * kBN + warp_n * 32 + j * 16) * kLds + kk, kLds);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) RF_WMMA::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
    // Buffer buf^1 was last read in iteration kt-1, before the barrier that
    // ended it, so it can be refilled now.
    if (kt + 1 < k_tiles) store_tile(buf ^ 1);
    __syncthreads();
  }

  // Epilogue through shared memory (the accumulator's element layout is
  // opaque): add the bias, round once to x's dtype, write coalesced rows.
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      RF_WMMA::store_matrix_sync(c_s + (warp_m * 32 + i * 16) * kLdc + warp_n * 32 + j * 16, acc[i][j], kLdc,
                                 RF_WMMA::mem_row_major);
    }
  __syncthreads();
  for (int idx = tid; idx < kBM * kBN; idx += kGemmThreads) {
    const int r = idx / kBN, cc = idx % kBN;
    const int m = m0 + r, n = n0 + cc;
    if (m < M && n < N) {
      const float b = bias != nullptr ? static_cast<float>(bias[n]) : 0.0f;
      y[static_cast<int64_t>(m) * N + n] = static_cast<scalar_t>(c_s[r * kLdc + cc] + b);
    }
  }
}

// grid (ceil(N / 128), ceil(M / 64)); block 256 threads. The tiling is for 32-lane warps (NVIDIA;
// RDNA such as gfx1201 in its default wave32): a wave64 device pass (CDNA: gfx90a, gfx942, or
// gfx1201 built with -mwavefrontsize64) compiles no body, and the host never launches the kernel
// there (int8_map_gemm.cu takes the GEMV path, whose 32-lane groups fit either wave size).
template <typename scalar_t>
__global__ void __launch_bounds__(kGemmThreads)
    int8_gemm_wmma_kernel(scalar_t* __restrict__ y, const scalar_t* __restrict__ x,
                          const int8_t* __restrict__ qweight, const c10::BFloat16* __restrict__ scales,
                          const c10::BFloat16* __restrict__ bias, int M, int N, int K) {
  if constexpr (kWarpSize == 32) {
    int8_gemm_wmma_tile<scalar_t>(y, x, qweight, scales, bias, M, N, K);
  } else {
    __builtin_trap();
  }
}

}  // namespace
}  // namespace ridgefill
