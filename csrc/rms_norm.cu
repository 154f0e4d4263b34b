// CUDA kernel for ridgefill::rms_norm (schema in bindings.cpp).
//
// Numerics follow the Hugging Face Llama/Qwen3 RMSNorm exactly: the row is
// normalised in fp32, rounded to the input dtype, and only then multiplied by
// the weight (product rounded to the input dtype again). Matching that order
// keeps bf16 outputs bit-comparable with the reference instead of 1 ulp off
// on every other element.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

#include "common.cuh"
#include "rms_norm_kernels.cuh"

namespace ridgefill {
namespace {

// Enough threads that each handles a few elements, rounded to 64 so blocks
// are whole warps on wave32 and wave64 hardware alike.
int threads_for(int64_t cols) {
  const int64_t rounded = ((cols + 63) / 64) * 64;
  return static_cast<int>(std::min<int64_t>(kMaxBlockThreads, rounded));
}

template <typename scalar_t>
void launch(at::Tensor& out, const at::Tensor& x2d, const at::Tensor& weight,
            double eps) {
  const int64_t rows = x2d.size(0);
  const int64_t cols = x2d.size(1);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  rms_norm_kernel<scalar_t>
      <<<static_cast<unsigned int>(rows), threads_for(cols), 0, stream>>>(
          out.data_ptr<scalar_t>(), x2d.const_data_ptr<scalar_t>(),
          weight.const_data_ptr<scalar_t>(), cols, x2d.stride(0),
          static_cast<float>(eps));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor rms_norm_cuda(const at::Tensor& x, const at::Tensor& weight,
                         double eps) {
  TORCH_CHECK(x.is_cuda(), "ridgefill::rms_norm: x must be a CUDA tensor, got ",
              x.device());
  TORCH_CHECK(weight.device() == x.device(),
              "ridgefill::rms_norm: weight is on ", weight.device(),
              " but x is on ", x.device());
  TORCH_CHECK(x.dim() >= 1, "ridgefill::rms_norm: x must have at least 1 dim");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1),
              "ridgefill::rms_norm: weight must be 1-D of size x.size(-1)=",
              x.size(-1), ", got shape ", weight.sizes());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 ||
                  dtype == at::kHalf,
              "ridgefill::rms_norm: unsupported dtype ", dtype,
              " (expected float32, bfloat16 or float16)");
  TORCH_CHECK(weight.scalar_type() == dtype,
              "ridgefill::rms_norm: weight dtype ", weight.scalar_type(),
              " must match x dtype ", dtype);
  TORCH_CHECK(x.size(-1) <= 1 || x.stride(-1) == 1,
              "ridgefill::rms_norm: the last dim of x must be contiguous "
              "(stride 1), got stride ",
              x.stride(-1));

  const c10::cuda::CUDAGuard device_guard(x.device());
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (out.numel() == 0) {
    return out;
  }
  // A view whenever the leading dims collapse to one stride (contiguous
  // tensors, row slices); otherwise reshape copies, which is still correct.
  const at::Tensor x2d = x.reshape({-1, x.size(-1)});
  TORCH_CHECK(x2d.size(0) <= std::numeric_limits<int32_t>::max(),
              "ridgefill::rms_norm: too many rows for one launch: ",
              x2d.size(0));
  const at::Tensor w = weight.contiguous();

  switch (dtype) {
    case at::kFloat:
      launch<float>(out, x2d, w, eps);
      break;
    case at::kBFloat16:
      launch<c10::BFloat16>(out, x2d, w, eps);
      break;
    case at::kHalf:
      launch<c10::Half>(out, x2d, w, eps);
      break;
    default:
      TORCH_CHECK(false, "unreachable");
  }
  return out;
}

}  // namespace
}  // namespace ridgefill

TORCH_LIBRARY_IMPL(ridgefill, CUDA, m) {
  m.impl("rms_norm", &ridgefill::rms_norm_cuda);
}
