// CUDA kernels for ridgefill::packed_linear and ridgefill::packed_dequantize_t (schemas in
// bindings.cpp; layout, references and the CPU kernels: ridgefill_runtime/ops/packed_linear.py,
// csrc/cpu/packed_linear.cpp).
//
// Weights stay group-quantized: panels of 16 output rows, k-major inside a panel, so 16 bytes
// hold 16 rows at one k pair (4 bits) or one k (8 bits) -- a "chunk" below. W[r, k] = q * scale
// (rounded to float32), then + min (rounded), exactly as the reference computes it; with float16
// scales q * scale is exact, so one FMA gives the same value, while float32 scales need the
// separate __fmul_rn / __fadd_rn (nvcc would otherwise contract them into an FMA).
//
// packed_linear (decode, M = 1..16: memory bound, every weight byte read once per call):
//  * A 32-lane team owns one panel (or 1/S of its k range when there are few panels) and reads
//    it with 16-byte loads. A lane takes a run of kRun consecutive chunks, which lie in one
//    scale group, so it converts the group's 16 scales (and mins) once per run, not per chunk;
//    a warp's loads still cover whole 32-byte sectors (2 lanes per 128-byte line).
//  * q is made a float with the 2^23 trick (integer bits or-ed into the mantissa, minus 2^23:
//    exact, and cheaper than the quarter-rate int-to-float conversion), dequantized in
//    registers, and multiplied into MT rows of x (fp32 FMAs): each lane accumulates 16 rows x MT.
//  * The team's 16 * MT partial sums are reduce-scattered with shuffles (each step halves what a
//    lane holds), so a full 16 * MT reduction costs about 16 * MT shuffles, not 5 * 16 * MT; the
//    S teams of a panel then add up in a fixed order in shared memory (deterministic, no atomics).
//  * M is cut into tiles of MT <= 4 rows (16 * 4 accumulators keep ~3 blocks per SM resident);
//    the tiles of one panel are adjacent block indices, so a tile after the first finds the
//    panel in L2. Any M works; many-row calls are meant for packed_dequantize_t + cuBLAS.
//  * Nothing is allocated but y (x is copied only if it is strided or misaligned) and nothing
//    synchronises the host, so the call can be captured in a CUDA graph.
// Teams are 32-lane groups, not hardware warps, so the host sizes grids without knowing the warp
// size and the shuffles (offsets <= 16) stay inside a team on wave64 too; blocks are 128 threads
// (whole warps on wave32 and wave64).
//
// packed_dequantize_t: one thread per chunk, panels fastest, so a warp's float4 stores of W.T
// rows are contiguous; values computed as the reference does (bit-identical), rows past n zero.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "common.cuh"
#include "packed_linear_kernels.cuh"

namespace ridgefill {
namespace {

// -- host ------------------------------------------------------------------------------------------

struct Checked {
  int64_t P, K;
  bool half_scale, has_min;
};

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0; }

Checked check_packed(const char* name, const at::Tensor& data, const at::Tensor& scale, const at::Tensor& min,
                     int64_t bits, int64_t group, int64_t n) {
  TORCH_CHECK(bits == 4 || bits == 8, name, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(data.is_cuda(), name, "data must be a CUDA tensor, got ", data.device());
  TORCH_CHECK(data.dim() == 3 && data.is_contiguous() && data.size(2) == kPanel &&
                  data.scalar_type() == (bits == 4 ? at::kByte : at::kChar),
              name, "data must be a contiguous ", bits == 4 ? "uint8 [P, K / 2, 16]" : "int8 [P, K, 16]",
              " tensor for bits=", bits, ", got ", data.scalar_type(), " ", data.sizes());
  const int64_t P = data.size(0), K = data.size(1) * (bits == 4 ? 2 : 1);
  TORCH_CHECK(bits == 8 || group % 2 == 0, name, "4-bit groups must hold an even number of k, got group=", group);
  TORCH_CHECK(group >= 1 && K % group == 0, name, "K=", K, " is not a multiple of group=", group);
  TORCH_CHECK(n > (P - 1) * kPanel && n <= P * kPanel, name, "n=", n, " does not fit ", P, " panels of 16 rows");
  TORCH_CHECK(scale.device() == data.device(), name, "scale is on ", scale.device(), " but data is on ",
              data.device());
  TORCH_CHECK(scale.scalar_type() == at::kHalf || scale.scalar_type() == at::kFloat, name,
              "scale must be float16 or float32, got ", scale.scalar_type());
  TORCH_CHECK(scale.is_contiguous() && scale.sizes() == at::IntArrayRef({P, K / group, kPanel}), name,
              "scale must be a contiguous [P, K / group, 16] = [", P, ", ", K / group, ", 16] tensor, got ",
              scale.sizes());
  const bool has_min = min.numel() > 0;
  if (has_min) {
    TORCH_CHECK(min.device() == data.device(), name, "min is on ", min.device(), " but data is on ", data.device());
    TORCH_CHECK(min.scalar_type() == scale.scalar_type() && min.is_contiguous() && min.sizes() == scale.sizes(),
                name, "min must match scale's dtype and shape, or be empty");
  }
  // 16-byte vector loads: the rows inside are multiples of 16 bytes, so only a base pointer (an
  // odd view) could be off; copying weights per call would hide a slow path, so refuse.
  TORCH_CHECK(aligned16(data) && aligned16(scale) && (!has_min || aligned16(min)), name,
              "data, scale and min must start 16-byte aligned");
  return Checked{P, K, scale.scalar_type() == at::kHalf, has_min};
}

template <template <int, typename, bool> class F, typename... Args>
void by_format(int64_t bits, bool half_scale, bool has_min, Args&&... args) {
  if (bits == 4) {
    if (half_scale) {
      has_min ? F<4, c10::Half, true>::run(args...) : F<4, c10::Half, false>::run(args...);
    } else {
      has_min ? F<4, float, true>::run(args...) : F<4, float, false>::run(args...);
    }
  } else {
    if (half_scale) {
      has_min ? F<8, c10::Half, true>::run(args...) : F<8, c10::Half, false>::run(args...);
    } else {
      has_min ? F<8, float, true>::run(args...) : F<8, float, false>::run(args...);
    }
  }
}

template <int BITS, typename ST, bool MIN>
struct LinearLauncher {
  static void run(const LinearArgs& a, int mt, dim3 grid, cudaStream_t stream) {
    launch_linear<BITS, ST, MIN>(a, mt, grid, stream);
  }
};

template <int BITS, typename ST, bool MIN>
struct DequantLauncher {
  static void run(const DequantArgs& a, unsigned blocks, cudaStream_t stream) {
    packed_dequantize_t_kernel<BITS, ST, MIN><<<blocks, 256, 0, stream>>>(a);
  }
};

at::Tensor packed_linear_cuda(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scale,
                              const at::Tensor& min, int64_t bits, int64_t group, int64_t n) {
  constexpr const char* kName = "ridgefill::packed_linear: ";
  const Checked w = check_packed(kName, data, scale, min, bits, group, n);
  TORCH_CHECK(x.device() == data.device(), kName, "x is on ", x.device(), " but data is on ", data.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == w.K, kName, "x must be float32 [M, ",
              w.K, "], got ", x.scalar_type(), " ", x.sizes());

  const c10::cuda::CUDAGuard device_guard(data.device());
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  // float2 loads of x at even k (4 bits); rows are K floats, K even, so only the base can be off.
  at::Tensor xc = x.contiguous();
  if (reinterpret_cast<uintptr_t>(xc.const_data_ptr()) % 8 != 0) xc = xc.clone();

  LinearArgs a{};
  a.y = y.data_ptr<float>();
  a.x = xc.const_data_ptr<float>();
  a.data = static_cast<const uint8_t*>(data.const_data_ptr());
  a.scale = scale.const_data_ptr();
  a.min = w.has_min ? min.const_data_ptr() : nullptr;
  a.M = M;
  a.n = n;
  a.K = w.K;
  a.P = w.P;
  a.chunks = bits == 4 ? w.K / 2 : w.K;
  a.groups = w.K / group;
  a.chunks_per_group = bits == 4 ? group / 2 : group;

  const bool in_runs = a.chunks_per_group % kRun == 0;  // else the one-chunk variant, tiles of 4 only
  const int mt = !in_runs ? 4 : M == 1 ? 1 : M == 2 ? 2 : 4;
  const int64_t m_tiles = ceil_div<int64_t>(M, mt);
  TORCH_CHECK(m_tiles <= std::numeric_limits<int32_t>::max(), kName, "too many rows for one launch: ", M);
  // Split a panel's k range over S teams only while there are too few teams to fill the GPU and
  // each lane keeps >= 2 runs (the cross-team sum costs a barrier and a shared-memory pass).
  const int64_t runs = a.chunks / (in_runs ? kRun : 1);
  const int64_t want_teams = 16LL * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int split = 1;
  while (split < kTeams && m_tiles * w.P * split < want_teams && runs >= 2LL * kTeam * (2 * split)) split *= 2;
  a.split = split;
  const int64_t panel_blocks = ceil_div<int64_t>(w.P, kTeams / split);
  // The kernel loops over panel blocks past gridDim.y (65535 at most).
  const dim3 grid(static_cast<unsigned>(m_tiles), static_cast<unsigned>(std::min<int64_t>(panel_blocks, 65535)));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  by_format<LinearLauncher>(bits, w.half_scale, w.has_min, a, mt, grid, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

at::Tensor packed_dequantize_t_cuda(const at::Tensor& data, const at::Tensor& scale, const at::Tensor& min,
                                    int64_t bits, int64_t group, int64_t n) {
  constexpr const char* kName = "ridgefill::packed_dequantize_t: ";
  const Checked w = check_packed(kName, data, scale, min, bits, group, n);
  const c10::cuda::CUDAGuard device_guard(data.device());
  at::Tensor wt = at::empty({w.K, w.P * kPanel}, data.options().dtype(at::kFloat));
  if (wt.numel() == 0) return wt;

  DequantArgs a{};
  a.wt = wt.data_ptr<float>();
  a.data = static_cast<const uint8_t*>(data.const_data_ptr());
  a.scale = scale.const_data_ptr();
  a.min = w.has_min ? min.const_data_ptr() : nullptr;
  a.n = n;
  a.K = w.K;
  a.P = w.P;
  a.chunks = bits == 4 ? w.K / 2 : w.K;
  a.groups = w.K / group;
  a.chunks_per_group = bits == 4 ? group / 2 : group;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div<int64_t>(w.P * a.chunks, 256), 32 * sms));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  by_format<DequantLauncher>(bits, w.half_scale, w.has_min, a, blocks, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return wt;
}

}  // namespace
}  // namespace ridgefill

TORCH_LIBRARY_IMPL(ridgefill, CUDA, m) {
  m.impl("packed_linear", &ridgefill::packed_linear_cuda);
  m.impl("packed_dequantize_t", &ridgefill::packed_dequantize_t_cuda);
}
