// Device side of ridgefill::packed_linear and packed_dequantize_t: the kernels and their launchers.
// Torch-free apart from c10's Half and BFloat16, so scripts/hip_check.sh can compile it for AMD
// targets without a ROCm build of torch; the host side (checks, allocation, dtype dispatch,
// registration) and the design notes are in packed_linear.cu.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#include "common.cuh"

namespace ridgefill {
namespace {

constexpr int kPanel = 16;          // output rows per panel (format constant)
constexpr int kTeam = kTeamSize;    // lanes per team (see packed_linear.cu's header comment)
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
// too few loads in flight to stream the weights). HIP reads launch bounds' second argument as a
// wave occupancy floor: on gfx942 it capped the kernels at 168 VGPRs with 476 spills, and at 208
// without it none (scripts/hip_check.sh), so ROCm builds give the block size alone.
#if defined(USE_ROCM)
#define RIDGEFILL_PACKED_LINEAR_BOUNDS(MT) __launch_bounds__(kThreads)
#else
#define RIDGEFILL_PACKED_LINEAR_BOUNDS(MT) __launch_bounds__(kThreads, (MT) >= 4 ? 3 : 4)
#endif
template <int BITS, typename ST, bool MIN, int MT, int R>
__global__ void RIDGEFILL_PACKED_LINEAR_BOUNDS(MT) packed_linear_kernel(const LinearArgs a) {
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

}  // namespace
}  // namespace ridgefill
