// Device side of the Gated DeltaNet ops: the scan kernel and its tile constants. Torch-free apart
// from c10's Half and BFloat16, so scripts/hip_check.sh can compile it for AMD targets without a
// ROCm build of torch; the host side (checks, allocation, dtype dispatch, registration) and the
// design notes are in gdn.cu.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>

#include "common.cuh"

namespace ridgefill {
namespace {

constexpr int kGdnThreads = 128;
constexpr int kGdnCols = 32;                         // value columns per block
constexpr int kGdnRowGroups = kGdnThreads / kGdnCols;  // 4 threads share a column
constexpr int kGdnSteps = 16;                        // time steps staged per barrier round
constexpr int kGdnMaxKeyDim = 256;
constexpr float kL2Eps = 1e-6f;  // transformers' l2norm (and FLA's) epsilon

// q/out may be null (state-only variant); init_state may be null (zeros).
template <typename scalar_t, int ROWS, bool HAS_Q>
__global__ void __launch_bounds__(kGdnThreads)
    gdn_scan_kernel(scalar_t* __restrict__ out,              // [B, T, Hv, Dv] or null
                    float* __restrict__ final_state,         // [B, Hv, Dk, Dv]
                    const scalar_t* __restrict__ q,          // [B, T, Hk, Dk] or null
                    const scalar_t* __restrict__ k,          // [B, T, Hk, Dk]
                    const scalar_t* __restrict__ v,          // [B, T, Hv, Dv]
                    const float* __restrict__ g,             // [B, T, Hv]
                    const float* __restrict__ beta,          // [B, T, Hv]
                    const float* __restrict__ init_state,    // [B, Hv, Dk, Dv] or null
                    int seq_len, int num_k_heads, int num_v_heads, int key_dim, int value_dim,
                    bool l2norm, float q_scale) {
  __shared__ float q_s[HAS_Q ? kGdnSteps : 1][kGdnMaxKeyDim];
  __shared__ float k_s[kGdnSteps][kGdnMaxKeyDim];
  __shared__ float v_s[kGdnSteps][kGdnCols];
  __shared__ float decay_s[kGdnSteps];
  __shared__ float beta_s[kGdnSteps];
  __shared__ float kq_s[kGdnSteps];
  // Double-buffered by step parity so one barrier per step suffices: a
  // thread can only overwrite buffer p again after the next step's barrier,
  // which every reader of p has passed.
  __shared__ float red[2][2][kGdnRowGroups][kGdnCols];

  const int col = threadIdx.x % kGdnCols;
  const int rg = threadIdx.x / kGdnCols;
  const int c = blockIdx.x * kGdnCols + col;
  const bool col_ok = c < value_dim;
  const int hv = blockIdx.y;
  const int b = blockIdx.z;
  const int hk = hv / (num_v_heads / num_k_heads);  // repeat_interleave grouping
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;

  // This thread's state entries: rows rg, rg + 4, ... of column c.
  float S[ROWS];
  const int64_t state_off = (static_cast<int64_t>(b) * num_v_heads + hv) * key_dim * value_dim;
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    const int d = rg + i * kGdnRowGroups;
    S[i] = (init_state != nullptr && col_ok && d < key_dim)
               ? init_state[state_off + static_cast<int64_t>(d) * value_dim + c]
               : 0.0f;
  }

  for (int t0 = 0; t0 < seq_len; t0 += kGdnSteps) {
    const int steps = min(kGdnSteps, seq_len - t0);
    __syncthreads();  // previous round's readers of the staging buffers are done
    // Stage k (and q) for the round, raw.
    for (int idx = threadIdx.x; idx < steps * key_dim; idx += blockDim.x) {
      const int s = idx / key_dim, d = idx % key_dim;
      const int64_t off = ((static_cast<int64_t>(b) * seq_len + t0 + s) * num_k_heads + hk) * key_dim + d;
      k_s[s][d] = static_cast<float>(k[off]);
      if constexpr (HAS_Q) q_s[s][d] = static_cast<float>(q[off]);
    }
    for (int idx = threadIdx.x; idx < steps * kGdnCols; idx += blockDim.x) {
      const int s = idx / kGdnCols, cc = blockIdx.x * kGdnCols + idx % kGdnCols;
      const int64_t off = ((static_cast<int64_t>(b) * seq_len + t0 + s) * num_v_heads + hv) * value_dim + cc;
      v_s[s][idx % kGdnCols] = cc < value_dim ? static_cast<float>(v[off]) : 0.0f;
    }
    if (static_cast<int>(threadIdx.x) < steps) {
      const int64_t off = (static_cast<int64_t>(b) * seq_len + t0 + threadIdx.x) * num_v_heads + hv;
      decay_s[threadIdx.x] = expf(g[off]);
      beta_s[threadIdx.x] = beta[off];
    }
    __syncthreads();
    // Per step: L2-normalise q and k (one warp per step), scale q, and k.q.
    for (int s = warp; s < steps; s += num_warps) {
      float kk = 0.0f, qq = 0.0f;
      for (int d = lane; d < key_dim; d += kWarpSize) {
        kk += k_s[s][d] * k_s[s][d];
        if constexpr (HAS_Q) qq += q_s[s][d] * q_s[s][d];
      }
      kk = warp_reduce_sum(kk);
      qq = warp_reduce_sum(qq);
      // 1/sqrtf rather than rsqrtf: correctly rounded, closer to torch.rsqrt.
      const float k_mul = l2norm ? 1.0f / sqrtf(kk + kL2Eps) : 1.0f;
      const float q_mul = (l2norm ? 1.0f / sqrtf(qq + kL2Eps) : 1.0f) * q_scale;
      float kq = 0.0f;
      for (int d = lane; d < key_dim; d += kWarpSize) {
        const float kd = k_s[s][d] * k_mul;
        k_s[s][d] = kd;
        if constexpr (HAS_Q) {
          const float qd = q_s[s][d] * q_mul;
          q_s[s][d] = qd;
          kq += kd * qd;
        }
      }
      kq = warp_reduce_sum(kq);
      if (lane == 0) kq_s[s] = kq;
    }
    __syncthreads();

    for (int s = 0; s < steps; ++s) {
      const int par = (t0 + s) & 1;
      float sk = 0.0f, sq = 0.0f;
#pragma unroll
      for (int i = 0; i < ROWS; ++i) {
        const int d = rg + i * kGdnRowGroups;
        if (d < key_dim) {
          sk += S[i] * k_s[s][d];
          if constexpr (HAS_Q) sq += S[i] * q_s[s][d];
        }
      }
      red[par][0][rg][col] = sk;
      if constexpr (HAS_Q) red[par][1][rg][col] = sq;
      __syncthreads();
      sk = 0.0f;
      sq = 0.0f;
#pragma unroll
      for (int r = 0; r < kGdnRowGroups; ++r) {
        sk += red[par][0][r][col];
        if constexpr (HAS_Q) sq += red[par][1][r][col];
      }
      const float decay = decay_s[s];
      const float delta = beta_s[s] * (v_s[s][col] - decay * sk);
      if constexpr (HAS_Q) {
        if (rg == 0 && col_ok) {
          const float o = decay * sq + kq_s[s] * delta;
          out[((static_cast<int64_t>(b) * seq_len + t0 + s) * num_v_heads + hv) * value_dim + c] =
              static_cast<scalar_t>(o);
        }
      }
#pragma unroll
      for (int i = 0; i < ROWS; ++i) {
        const int d = rg + i * kGdnRowGroups;
        if (d < key_dim) S[i] = decay * S[i] + k_s[s][d] * delta;
      }
    }
  }

#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    const int d = rg + i * kGdnRowGroups;
    if (col_ok && d < key_dim) final_state[state_off + static_cast<int64_t>(d) * value_dim + c] = S[i];
  }
}

}  // namespace
}  // namespace ridgefill
