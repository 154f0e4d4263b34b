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
// HIP: the WMMA API is reached through the RF_WMMA namespace alias (int8_map_gemm_wmma.cuh).
// On ROCm it maps to rocWMMA (same fragment/load/mma/store API; gfx1201 is
// supported by rocWMMA >= 1.7); no inline PTX is used on either side.
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
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>

#include "common.cuh"
#include "dispatch.cuh"
#include "int8_map_gemm_wmma.cuh"

namespace ridgefill {
namespace {

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

  // The WMMA tiling is for 32-lane warps (NVIDIA; RDNA such as gfx1201 in wave32). A wave64 device
  // (CDNA: gfx90a, gfx942) takes the GEMV path, whose 32-lane groups fit both wave sizes.
  // NOTE: a CDNA tiling (64-lane warps over MFMA) would serve large M there; not written yet.
  const bool wave32 = at::cuda::getCurrentDeviceProperties()->warpSize == 32;
  const bool use_mma = dtype != at::kFloat && M > kGemvMaxRows && wave32;
  RIDGEFILL_DISPATCH_FLOAT_TYPES(dtype, "int8_map_gemm", [&] {
    if (use_mma) {
      launch_mma<scalar_t>(y, xc, qc, sc, bias_ptr, M, N, K, stream);
      return;
    }
    const dim3 grid(static_cast<unsigned>(ceil_div<int64_t>(N, kGemvCols)),
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
