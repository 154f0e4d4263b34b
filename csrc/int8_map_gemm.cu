// CUDA kernels for ridgefill::int8_map_gemm (schema in bindings.cpp; format,
// reference and quantizer in ridgefill_runtime/ops/int8_map_gemm.py).
//
//   y[m, n] = sum_k x[m, k] * (qweight[n, k] * scales[n, k / 128]) + bias[n]
//
// W8A16 with one bf16 scale per 128 consecutive weights of a row: the
// RidgeFill map format (seed 000: "int8 with one scale per 128 weights of
// each row"). Two paths:
//  * M <= kGemvMaxRows (decode-like, probe-sized): a GEMV-style kernel; one
//    warp per output column streams that weight row once with 16-byte loads,
//    applies the group scale to each 16-weight partial sum in fp32 (so the
//    dequantised weight is never rounded) and serves up to 8 rows of x.
//    Also the path for float32 x at any M (no fp32 tensor-core MMA).
//  * larger M, bf16/fp16: a tensor-core GEMM. Each 128x32 weight tile is
//    dequantised into x's dtype in shared memory (the same rounding torch
//    gets from `x @ w_dequant.to(x.dtype).T`) and fed to WMMA 16x16x16
//    fragments with fp32 accumulation; the next tile's global loads are
//    issued before the current tile's MMAs (register double buffering).
//
// HIP: the WMMA API is reached through the RF_WMMA namespace alias below.
// On ROCm it maps to rocWMMA (same fragment/load/mma/store API; gfx1201 is
// supported by rocWMMA >= 1.7); no inline PTX is used on either side.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

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

#include <cstdint>
#include <limits>

#include "common.cuh"
#include "dispatch.cuh"

namespace ridgefill {
namespace {

constexpr int kGroup = 128;        // weights per scale along d_in (format constant)
constexpr int kGemvMaxRows = 8;    // M at or below this takes the GEMV path
constexpr int kGemvThreads = 256;  // 8 warps = 8 output columns per block (wave32)

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
  const int lane = threadIdx.x % 32;
  const int n = blockIdx.x * (kGemvThreads / 32) + threadIdx.x / 32;
  if (n >= N) return;  // no barriers below; a group exits as a whole
  const int m0 = blockIdx.y * kGemvMaxRows;
  const int rows = min(kGemvMaxRows, M - m0);
  const int groups = K / kGroup;
  const int8_t* wrow = qweight + static_cast<int64_t>(n) * K;

  float acc[kGemvMaxRows];
#pragma unroll
  for (int m = 0; m < kGemvMaxRows; ++m) acc[m] = 0.0f;

  // 16 weights per lane per step: a warp streams 512 contiguous bytes.
  for (int k = lane * 16; k < K; k += 32 * 16) {
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

// grid (ceil(N / 128), ceil(M / 64)); block 256 threads.
template <typename scalar_t>
__global__ void __launch_bounds__(kGemmThreads)
    int8_gemm_wmma_kernel(scalar_t* __restrict__ y,                  // [M, N]
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
  const int warp = tid / 32;  // this path is CUDA/rocWMMA wave32 only (see launcher)
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

template <typename scalar_t>
void launch_mma(at::Tensor& y, const at::Tensor& xc, const at::Tensor& qc, const at::Tensor& sc,
                const c10::BFloat16* bias_ptr, int64_t M, int64_t N, int64_t K, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div<int64_t>(N, kBN)), static_cast<unsigned>(ceil_div<int64_t>(M, kBM)));
  int8_gemm_wmma_kernel<scalar_t><<<grid, kGemmThreads, 0, stream>>>(
      y.data_ptr<scalar_t>(), xc.const_data_ptr<scalar_t>(), qc.const_data_ptr<int8_t>(),
      sc.const_data_ptr<c10::BFloat16>(), bias_ptr, static_cast<int>(M), static_cast<int>(N), static_cast<int>(K));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// fp32 has no 16-bit MMA: never dispatched (use_mma is false), and the
// explicit specialisation keeps the WMMA kernel from being instantiated.
template <>
void launch_mma<float>(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const c10::BFloat16*,
                       int64_t, int64_t, int64_t, cudaStream_t) {
  TORCH_CHECK(false, "ridgefill::int8_map_gemm: no tensor-core path for float32");
}

// ---------------------------------------------------------------------------
at::Tensor int8_map_gemm_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& bias) {
  constexpr const char* kName = "ridgefill::int8_map_gemm: ";
  TORCH_CHECK(x.is_cuda(), kName, "x must be a CUDA tensor, got ", x.device());
  TORCH_CHECK(x.dim() == 2, kName, "x must be [M, d_in], got ", x.sizes());
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar, kName,
              "qweight must be int8 [d_out, d_in]");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == K, kName, "qweight has d_in=", qweight.size(1), " but x has ", K);
  TORCH_CHECK(K % kGroup == 0, kName, "d_in must be a multiple of ", kGroup, ", got ", K);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == K / kGroup &&
                  scales.scalar_type() == at::kBFloat16,
              kName, "scales must be bfloat16 [d_out, d_in / 128] = [", N, ", ", K / kGroup, "], got ",
              scales.scalar_type(), " ", scales.sizes());
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kBFloat16, kName,
                "bias must be bfloat16 [d_out]");
    TORCH_CHECK(bias->device() == x.device(), kName, "bias is on ", bias->device());
  }
  TORCH_CHECK(qweight.device() == x.device() && scales.device() == x.device(), kName,
              "qweight and scales must be on ", x.device());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, kName,
              "unsupported dtype ", dtype);
  TORCH_CHECK(M <= std::numeric_limits<int32_t>::max() && N <= std::numeric_limits<int32_t>::max() &&
                  K <= std::numeric_limits<int32_t>::max(),
              kName, "too large for one launch");

  const c10::cuda::CUDAGuard device_guard(x.device());
  at::Tensor y = at::empty({M, N}, x.options());
  if (y.numel() == 0) return y;
  if (K == 0) {  // an empty sum: y is the bias (or zeros), like the reference
    return bias.has_value() ? y.copy_(bias->to(dtype).expand({M, N})) : y.zero_();
  }

  // 16-byte vector loads: rows are multiples of 128 elements, so only the
  // base pointers can be misaligned (a sliced view); copy those.
  auto aligned = [](const at::Tensor& t) {
    at::Tensor c = t.contiguous();
    return reinterpret_cast<uintptr_t>(c.const_data_ptr()) % 16 == 0 ? c : c.clone();
  };
  const at::Tensor xc = aligned(x);
  const at::Tensor qc = aligned(qweight);
  const at::Tensor sc = scales.contiguous();
  const at::Tensor bc = bias.has_value() ? bias->contiguous() : at::Tensor();
  const c10::BFloat16* bias_ptr = bc.defined() ? bc.const_data_ptr<c10::BFloat16>() : nullptr;
  const auto stream = c10::cuda::getCurrentCUDAStream();

  // NOTE: the WMMA tiling assumes 32-lane warps (NVIDIA, RDNA/gfx1201 on
  // ROCm). A CDNA (wave64) build would need its own warp tiling.
  const bool use_mma = dtype != at::kFloat && M > kGemvMaxRows;
  RIDGEFILL_DISPATCH_FLOAT_TYPES(dtype, "int8_map_gemm", [&] {
    if (use_mma) {
      launch_mma<scalar_t>(y, xc, qc, sc, bias_ptr, M, N, K, stream);
      return;
    }
    const int cols_per_block = kGemvThreads / 32;
    const dim3 grid(static_cast<unsigned>(ceil_div<int64_t>(N, cols_per_block)),
                    static_cast<unsigned>(ceil_div<int64_t>(M, kGemvMaxRows)));
    int8_gemv_kernel<scalar_t><<<grid, kGemvThreads, 0, stream>>>(
        y.data_ptr<scalar_t>(), xc.const_data_ptr<scalar_t>(), qc.const_data_ptr<int8_t>(),
        sc.const_data_ptr<c10::BFloat16>(), bias_ptr, static_cast<int>(M), static_cast<int>(N),
        static_cast<int>(K));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return y;
}

}  // namespace
}  // namespace ridgefill

TORCH_LIBRARY_IMPL(ridgefill, CUDA, m) {
  m.impl("int8_map_gemm", &ridgefill::int8_map_gemm_cuda);
}
