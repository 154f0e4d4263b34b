// Shared block routine for the "few query rows over many keys" attention
// kernels (scattered_rows_attention.cu, ripe_attention.cu).
//
// One thread block serves one query row and one KV head, and all the query
// heads of that KV head's group (up to MAXG at once): every K/V row it reads
// from memory is used for all of them, which is what makes decode-like shapes
// bandwidth-bound instead of G times over. The keys are dealt round-robin to
// the warps; each warp keeps an online (flash-style) softmax per head in fp32
// and the warps' partial results are merged through shared memory at the end.
//
// Where key j lives is the only thing that differs between the ops, so it is
// a template parameter: a Locator with
//   __device__ const scalar_t* k(int j) const;  // -> K[j, kv_head, 0..D)
//   __device__ const scalar_t* v(int j) const;  // -> V[j, kv_head, 0..D)
//
// No inline PTX: hipify translates this unchanged (warp size from common.cuh).
#pragma once

#include <cmath>

#include "common.cuh"

namespace ridgefill {

constexpr int kAttnThreads = 256;  // 8 warps on wave32, 4 on wave64
constexpr int kAttnMaxWarps = kAttnThreads / kTeamSize;  // warps are 32 or 64 lanes
constexpr int kAttnMaxHeadDim = 256;

// Shared memory of attend_rows: per-warp partial outputs of one head, the
// per-warp softmax statistics, and the merged statistics per head (needed by
// the key-mass pass).
template <int MAXG>
struct AttnSmem {
  float acc[kAttnMaxWarps][kAttnMaxHeadDim];
  float m[kAttnMaxWarps];
  float l[kAttnMaxWarps];
  float final_m[MAXG];
  float final_l[MAXG];
};

// Where attend_rows_into puts each head's merged result. OutRows (what
// attend_rows uses) writes the normalised output in scalar_t; a split-KV
// caller (scattered_rows_attention.cu) passes a sink that keeps the
// unnormalised sum and the softmax statistics of its key chunk instead.
//   value(g, d, o, inv_l): o = sum over keys of exp(s - m) * v[d] for head g,
//                          inv_l = 1 / sum of exp(s - m) (0 when no key)
//   stats(g, m, l):        the max score and the sum of exp(s - m); called by
//                          thread 0 only
template <typename scalar_t>
struct OutRows {
  scalar_t* row;
  int64_t head_stride;
  __device__ __forceinline__ void value(int g, int d, float o, float inv_l) const {
    row[g * head_stride + d] = static_cast<scalar_t>(o * inv_l);
  }
  __device__ __forceinline__ void stats(int, float, float) const {}
};

// q_row: this row's queries of head q_head0 .. q_head0+g_count-1, each D
// contiguous, heads q_head_stride apart; sink receives head g's result.
// Keys 0 .. n_keys-1 are visible (causality is the caller's n_keys).
// key_mass: when KEY_MASS, key j's probability summed over these heads is
// atomically added to key_mass[j].
//
// DPL: head-dim elements per lane (D <= 32 * DPL); lane l owns the contiguous
// elements [l*DPL, l*DPL + DPL) so that a warp reads one K row as a single
// contiguous run.
template <typename scalar_t, int DPL, int MAXG, bool KEY_MASS, typename Locator, typename Sink>
__device__ void attend_rows_into(const scalar_t* __restrict__ q_row, int64_t q_head_stride,
                                 const Sink& sink, int g_count, int n_keys, int head_dim, float scale,
                                 const Locator& loc, float* __restrict__ key_mass,
                                 AttnSmem<MAXG>& smem) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  const int d0 = lane * DPL;

  // Queries pre-multiplied by the softmax scale, in fp32 registers.
  float q[MAXG][DPL];
#pragma unroll
  for (int g = 0; g < MAXG; ++g) {
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      const int d = d0 + i;
      q[g][i] = (g < g_count && d < head_dim)
                    ? static_cast<float>(q_row[g * q_head_stride + d]) * scale
                    : 0.0f;
    }
  }

  float m[MAXG], l[MAXG], acc[MAXG][DPL];
#pragma unroll
  for (int g = 0; g < MAXG; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[g][i] = 0.0f;
  }

  for (int j = warp; j < n_keys; j += num_warps) {
    const scalar_t* k = loc.k(j);
    float kv[DPL];
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      kv[i] = (d0 + i < head_dim) ? static_cast<float>(k[d0 + i]) : 0.0f;
    }
    float s[MAXG];
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
      // g_count is block-uniform, so the shuffles stay warp-converged; the
      // test skips the reductions of unused head slots (MHA, small groups).
      s[g] = 0.0f;
      if (g < g_count) {
        float part = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) part += q[g][i] * kv[i];
        s[g] = warp_reduce_sum(part);  // every lane holds the full score
      }
    }
    const scalar_t* v = loc.v(j);
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      kv[i] = (d0 + i < head_dim) ? static_cast<float>(v[d0 + i]) : 0.0f;
    }
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
      // s is finite, so m_new is finite and exp(m - m_new) is 0 on the
      // first key (m = -inf), never NaN.
      const float m_new = fmaxf(m[g], s[g]);
      const float corr = expf(m[g] - m_new);
      const float p = expf(s[g] - m_new);
      l[g] = l[g] * corr + p;
#pragma unroll
      for (int i = 0; i < DPL; ++i) acc[g][i] = acc[g][i] * corr + p * kv[i];
      m[g] = m_new;
    }
  }

  // Merge the warps, one head at a time (keeps shared memory at one head's
  // worth of partial outputs). The loop bound is block-uniform, so the
  // barriers inside are reached by every thread.
  for (int g = 0; g < g_count; ++g) {
    // Select the register arrays with a compile-time index (a runtime index
    // would push them to local memory).
    float mg = 0.0f, lg = 0.0f, ag[DPL];
#pragma unroll
    for (int gg = 0; gg < MAXG; ++gg) {
      if (gg == g) {
        mg = m[gg];
        lg = l[gg];
#pragma unroll
        for (int i = 0; i < DPL; ++i) ag[i] = acc[gg][i];
      }
    }
    if (lane == 0) {
      smem.m[warp] = mg;
      smem.l[warp] = lg;
    }
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      if (d0 + i < head_dim) smem.acc[warp][d0 + i] = ag[i];
    }
    __syncthreads();
    float big_m = -INFINITY;
    for (int w = 0; w < num_warps; ++w) big_m = fmaxf(big_m, smem.m[w]);
    float big_l = 0.0f;
    for (int w = 0; w < num_warps; ++w) {
      // A warp that saw no key has m = -inf and contributes nothing; the
      // test avoids exp(-inf - -inf) = NaN when no warp saw a key.
      if (smem.m[w] != -INFINITY) big_l += smem.l[w] * expf(smem.m[w] - big_m);
    }
    const float inv_l = big_l > 0.0f ? 1.0f / big_l : 0.0f;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
      float o = 0.0f;
      for (int w = 0; w < num_warps; ++w) {
        if (smem.m[w] != -INFINITY) o += smem.acc[w][d] * expf(smem.m[w] - big_m);
      }
      sink.value(g, d, o, inv_l);
    }
    if (threadIdx.x == 0) sink.stats(g, big_m, big_l);
    if (KEY_MASS && threadIdx.x == 0) {
      smem.final_m[g] = big_m;
      smem.final_l[g] = inv_l;  // stored inverted: the mass pass multiplies
    }
    __syncthreads();
  }

  if constexpr (KEY_MASS) {
    // Second pass: now that each head's normaliser is known, recompute the
    // scores and add every key's probability, summed over the group's heads.
    // One atomic per key per block; rows and KV heads of one sequence add to
    // the same entries.
    for (int j = warp; j < n_keys; j += num_warps) {
      const scalar_t* k = loc.k(j);
      float kv[DPL];
#pragma unroll
      for (int i = 0; i < DPL; ++i) {
        kv[i] = (d0 + i < head_dim) ? static_cast<float>(k[d0 + i]) : 0.0f;
      }
      float mass = 0.0f;
#pragma unroll
      for (int g = 0; g < MAXG; ++g) {
        if (g < g_count) {
          float part = 0.0f;
#pragma unroll
          for (int i = 0; i < DPL; ++i) part += q[g][i] * kv[i];
          const float s = warp_reduce_sum(part);
          mass += expf(s - smem.final_m[g]) * smem.final_l[g];
        }
      }
      if (lane == 0) atomicAdd(key_mass + j, mass);
    }
  }
}

// The normalised output in scalar_t, out_row laid out like q_row.
template <typename scalar_t, int DPL, int MAXG, bool KEY_MASS, typename Locator>
__device__ __forceinline__ void attend_rows(const scalar_t* __restrict__ q_row, int64_t q_head_stride,
                                            scalar_t* __restrict__ out_row, int64_t out_head_stride,
                                            int g_count, int n_keys, int head_dim, float scale,
                                            const Locator& loc, float* __restrict__ key_mass,
                                            AttnSmem<MAXG>& smem) {
  attend_rows_into<scalar_t, DPL, MAXG, KEY_MASS>(q_row, q_head_stride, OutRows<scalar_t>{out_row, out_head_stride},
                                                  g_count, n_keys, head_dim, scale, loc, key_mass, smem);
}

// Host-side choice of the templates: DPL from the head dim, MAXG so that the
// per-thread query and accumulator arrays stay at 32 floats each.
#define RIDGEFILL_DISPATCH_HEAD_DIM(head_dim, ...)                          \
  [&] {                                                                     \
    if ((head_dim) <= 64) {                                                 \
      constexpr int kDpl = 2;                                               \
      constexpr int kMaxG = 16;                                             \
      return __VA_ARGS__();                                                 \
    } else if ((head_dim) <= 128) {                                         \
      constexpr int kDpl = 4;                                               \
      constexpr int kMaxG = 8;                                              \
      return __VA_ARGS__();                                                 \
    } else {                                                                \
      constexpr int kDpl = 8;                                               \
      constexpr int kMaxG = 4;                                              \
      return __VA_ARGS__();                                                 \
    }                                                                       \
  }()

}  // namespace ridgefill
