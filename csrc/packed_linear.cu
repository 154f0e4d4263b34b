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

namespace ridgefill {
namespace {

constexpr int kPanel = 16;          // output rows per panel (format constant)
constexpr int kTeam = 32;           // lanes per team (see the header comment)
constexpr int kThreads = 128;       // 4 teams per block
constexpr int kTeams = kThreads / kTeam;
constexpr int kRun = 4;             // chunks per lane run when a group holds a multiple of 4
constexpr float kTwo23 = 8388608.0f;

// -- shared device helpers ------------------------------------------------------------------------

// 16 consecutive scales (one per row of a panel) as floats; p is 16-byte aligned (the host
// checks the base pointer; each [p, g] row starts at a multiple of 16 elements).
__device__ __forceinline__ void load_row16(const c10::Half* p, float (&out)[kPanel]) {
  const uint4 a = reinterpret_cast<const uint4*>(p)[0];
  const uint4 b = reinterpret_cast<const uint4*>(p)[1];
  const c10::Half* ea = reinterpret_cast<const c10::Half*>(&a);
  const c10::Half* eb = reinterpret_cast<const c10::Half*>(&b);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<float>(ea[i]);
    out[8 + i] = static_cast<float>(eb[i]);
  }
}

__device__ __forceinline__ void load_row16(const float* p, float (&out)[kPanel]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 f = reinterpret_cast<const float4*>(p)[i];
    out[4 * i + 0] = f.x;
    out[4 * i + 1] = f.y;
    out[4 * i + 2] = f.z;
    out[4 * i + 3] = f.w;
  }
}

// q of byte `j` (0..3) of word u as a float, exactly: the value sits in the low mantissa bits of
// 2^23. 4 bits: HIGH picks the odd-k nibble. 8 bits: u was xor-ed with 0x80808080 (two's
// complement -> offset binary), so subtracting 2^23 + 128 gives the signed value.
template <int BITS, bool HIGH = false>
__device__ __forceinline__ float q_of(uint32_t u, int j) {
  if constexpr (BITS == 4) {
    const uint32_t v = (u >> (8 * j + (HIGH ? 4 : 0))) & 0xFu;
    return __uint_as_float(0x4B000000u | v) - kTwo23;
  } else {
    const uint32_t v = (u >> (8 * j)) & 0xFFu;
    return __uint_as_float(0x4B000000u | v) - (kTwo23 + 128.0f);
  }
}

// The weight q * scale (+ min), as the reference rounds it.
template <typename ST, bool MIN>
__device__ __forceinline__ float dequant(float q, float s, float z) {
  if constexpr (!MIN) {
    return __fmul_rn(q, s);
  } else if constexpr (std::is_same_v<ST, c10::Half>) {
    return fmaf(q, s, z);  // q * s is exact (<= 8 + 11 significant bits): one rounding, same value
  } else {
    return __fadd_rn(__fmul_rn(q, s), z);
  }
}

// Reduce-scatter over the 32 lanes of a team: lane values v[0..C) -> after the call a lane holds
// max(C / 32, 1) sums over all 32 lanes, at original indices base + i. At offset O a lane keeps
// the half of its values selected by its lane bit O and sends the other half to lane ^ O; once a
// lane holds one value, the remaining offsets just add (so with C < 32 lanes hold duplicates).
template <int C, int O>
__device__ __forceinline__ void reduce_scatter(float* v, int lane, int& base) {
  if constexpr (O >= 1) {
    if constexpr (C > 1) {
      constexpr int H = C / 2;
      const bool up = (lane & O) != 0;
#pragma unroll
      for (int i = 0; i < H; ++i) {
        const float send = up ? v[i] : v[i + H];
        const float keep = up ? v[i + H] : v[i];
        v[i] = keep + shfl_xor(send, O);
      }
      base += up ? H : 0;
      reduce_scatter<H, O / 2>(v, lane, base);
    } else {
      v[0] += shfl_xor(v[0], O);
      reduce_scatter<1, O / 2>(v, lane, base);
    }
  }
}

// -- packed_linear ---------------------------------------------------------------------------------

struct LinearArgs {
  float* y;              // [M, n]
  const float* x;        // [M, K]
  const uint8_t* data;   // [P, chunks, 16]
  const void* scale;     // [P, K / group, 16]
  const void* min;       // same, or null
  int64_t M, n, K, P;
  int64_t chunks;        // per panel: K / 2 (4 bits) or K (8 bits)
  int64_t groups;        // K / group
  int64_t chunks_per_group;
  int split;             // S: teams per panel (1, 2 or 4)
};

// grid (M tiles, panel blocks); 128 threads = 4 teams; a block owns 4 / S panels. At least 3-4
// blocks per SM: left alone, ptxas gave the 4-row tile 255 registers (2 blocks, 8 warps per SM:
// too few loads in flight to stream the weights).
template <int BITS, typename ST, bool MIN, int MT, int R>
__global__ void __launch_bounds__(kThreads, MT >= 4 ? 3 : 4) packed_linear_kernel(const LinearArgs a) {
  constexpr int V = kPanel * MT;                  // partial sums per lane
  constexpr int KEPT = V >= kTeam ? V / kTeam : 1;  // values a lane holds after the reduce-scatter
  __shared__ float red[kTeams][V];

  const int lane = threadIdx.x % kTeam;
  const int team = threadIdx.x / kTeam;
  const int S = a.split;
  const int panels_per_block = kTeams / S;
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * MT;
  const int64_t left = a.M - m0;
  const int rows = left < MT ? static_cast<int>(left) : MT;
  const int64_t runs = a.chunks / R;
  const ST* scale = static_cast<const ST*>(a.scale);
  const ST* mins = static_cast<const ST*>(a.min);

  const int64_t panel_blocks = ceil_div<int64_t>(a.P, panels_per_block);
  for (int64_t pb = blockIdx.y; pb < panel_blocks; pb += gridDim.y) {
    const int64_t panel = pb * panels_per_block + team / S;
    const int part = team % S;

    float acc[V];
#pragma unroll
    for (int i = 0; i < V; ++i) acc[i] = 0.0f;

    if (panel < a.P) {
      const uint4* src = reinterpret_cast<const uint4*>(a.data + panel * a.chunks * 16);
      for (int64_t r = part * kTeam + lane; r < runs; r += static_cast<int64_t>(S) * kTeam) {
        const int64_t c0 = r * R;
        uint4 d[R];
#pragma unroll
        for (int u = 0; u < R; ++u) d[u] = src[c0 + u];
        const int64_t at = (panel * a.groups + c0 / a.chunks_per_group) * kPanel;
        float s[kPanel], z[kPanel];
        load_row16(scale + at, s);
        if constexpr (MIN) load_row16(mins + at, z);
#pragma unroll
        for (int u = 0; u < R; ++u) {
          const int64_t c = c0 + u;
          const uint32_t w4[4] = {d[u].x, d[u].y, d[u].z, d[u].w};
          if constexpr (BITS == 4) {
            // x at k = 2c and 2c + 1; rows past M read as 0 (no branch in the FMA loop)
            float x0[MT], x1[MT];
#pragma unroll
            for (int m = 0; m < MT; ++m) {
              float2 xv = make_float2(0.0f, 0.0f);
              if (m < rows) xv = *reinterpret_cast<const float2*>(a.x + (m0 + m) * a.K + 2 * c);
              x0[m] = xv.x;
              x1[m] = xv.y;
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
#pragma unroll
              for (int j = 0; j < 4; ++j) {
                const int row = 4 * i + j;
                const float zr = MIN ? z[row] : 0.0f;
                const float wl = dequant<ST, MIN>(q_of<4, false>(w4[i], j), s[row], zr);
                const float wh = dequant<ST, MIN>(q_of<4, true>(w4[i], j), s[row], zr);
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                  acc[m * kPanel + row] = fmaf(wl, x0[m], acc[m * kPanel + row]);
                  acc[m * kPanel + row] = fmaf(wh, x1[m], acc[m * kPanel + row]);
                }
              }
            }
          } else {
            float x0[MT];
#pragma unroll
            for (int m = 0; m < MT; ++m) x0[m] = m < rows ? a.x[(m0 + m) * a.K + c] : 0.0f;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const uint32_t u8 = w4[i] ^ 0x80808080u;
#pragma unroll
              for (int j = 0; j < 4; ++j) {
                const int row = 4 * i + j;
                const float w = dequant<ST, MIN>(q_of<8>(u8, j), s[row], MIN ? z[row] : 0.0f);
#pragma unroll
                for (int m = 0; m < MT; ++m) acc[m * kPanel + row] = fmaf(w, x0[m], acc[m * kPanel + row]);
              }
            }
          }
        }
      }
    }

    // Every team takes part (panels past P hold zeros), so the shuffles never diverge.
    int base = 0;
    reduce_scatter<V, kTeam / 2>(acc, lane, base);
    bool writes = true;
    if constexpr (V < kTeam) writes = lane % (kTeam / V) == 0;  // one of the lanes holding a duplicate
    if (writes) {
#pragma unroll
      for (int i = 0; i < KEPT; ++i) red[team][base + i] = acc[i];
    }
    __syncthreads();
    if (part == 0 && panel < a.P) {
      const int64_t col0 = panel * kPanel;
      for (int idx = lane; idx < V; idx += kTeam) {
        float total = 0.0f;
        for (int t = 0; t < S; ++t) total += red[team + t][idx];  // fixed order: deterministic
        const int m = idx / kPanel, row = idx % kPanel;
        if (m < rows && col0 + row < a.n) a.y[(m0 + m) * a.n + col0 + row] = total;
      }
    }
    __syncthreads();  // red is rewritten by the next panel block
  }
}

template <int BITS, typename ST, bool MIN, int R>
void launch_linear_mt(const LinearArgs& a, int mt, dim3 grid, cudaStream_t stream) {
  switch (mt) {
    case 1: packed_linear_kernel<BITS, ST, MIN, 1, R><<<grid, kThreads, 0, stream>>>(a); break;
    case 2: packed_linear_kernel<BITS, ST, MIN, 2, R><<<grid, kThreads, 0, stream>>>(a); break;
    default: packed_linear_kernel<BITS, ST, MIN, 4, R><<<grid, kThreads, 0, stream>>>(a); break;
  }
}

template <int BITS, typename ST, bool MIN>
void launch_linear(const LinearArgs& a, int mt, dim3 grid, cudaStream_t stream) {
  if (a.chunks_per_group % kRun == 0) {
    launch_linear_mt<BITS, ST, MIN, kRun>(a, mt, grid, stream);
  } else {
    // NOTE: odd groups (no GGUF format has one) take one chunk per run, one tile size.
    packed_linear_kernel<BITS, ST, MIN, 4, 1><<<grid, kThreads, 0, stream>>>(a);
  }
}

// -- packed_dequantize_t ---------------------------------------------------------------------------

struct DequantArgs {
  float* wt;             // [K, P * 16]
  const uint8_t* data;
  const void* scale;
  const void* min;
  int64_t n, K, P, chunks, groups, chunks_per_group;
};

__device__ __forceinline__ void store_row16(float* p, const float (&v)[kPanel]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    reinterpret_cast<float4*>(p)[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
  }
}

template <int BITS, typename ST, bool MIN>
__global__ void __launch_bounds__(256) packed_dequantize_t_kernel(const DequantArgs a) {
  const ST* scale = static_cast<const ST*>(a.scale);
  const ST* mins = static_cast<const ST*>(a.min);
  const int64_t ld = a.P * kPanel;
  const int64_t total = a.P * a.chunks;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t panel = i % a.P, c = i / a.P;
    const uint4 d = reinterpret_cast<const uint4*>(a.data + panel * a.chunks * 16)[c];
    const int64_t at = (panel * a.groups + c / a.chunks_per_group) * kPanel;
    float s[kPanel], z[kPanel];
    load_row16(scale + at, s);
    if constexpr (MIN) load_row16(mins + at, z);
    const int64_t live = a.n - panel * kPanel;  // rows of this panel below n (the rest are written 0)
    const uint32_t w4[4] = {d.x, d.y, d.z, d.w};
    float lo[kPanel], hi[kPanel];
#pragma unroll
    for (int ii = 0; ii < 4; ++ii) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int row = 4 * ii + j;
        const float zr = MIN ? z[row] : 0.0f;
        if constexpr (BITS == 4) {
          lo[row] = row < live ? dequant<float, MIN>(q_of<4, false>(w4[ii], j), s[row], zr) : 0.0f;
          hi[row] = row < live ? dequant<float, MIN>(q_of<4, true>(w4[ii], j), s[row], zr) : 0.0f;
        } else {
          lo[row] = row < live ? dequant<float, MIN>(q_of<8>(w4[ii] ^ 0x80808080u, j), s[row], zr) : 0.0f;
        }
      }
    }
    // dequant<float, ...>: the reference's separate multiply and add whatever the scale type
    // (for float16 scales the FMA would give the same bits; this kernel is not the hot path).
    const int64_t k = BITS == 4 ? 2 * c : c;
    store_row16(a.wt + k * ld + panel * kPanel, lo);
    if constexpr (BITS == 4) store_row16(a.wt + (k + 1) * ld + panel * kPanel, hi);
  }
}

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
