// CUDA kernels for the Gated DeltaNet ops ridgefill::gdn_chunk, gdn_step and
// gdn_state_update (schemas in bindings.cpp; convention, layouts and the
// chunked/recurrent references in ridgefill_runtime/ops/gdn.py).
//
// Per value head, with q, k L2-normalised (optional) and q scaled by
// 1/sqrt(d_k), all in fp32 like transformers' torch_*_gated_delta_rule:
//   S' = exp(g_t) S;  delta = beta_t (v_t - S'^T k_t);  S = S' + k_t delta^T;
//   o_t = S^T q_t.
// One pass over the old state gives both S^T k and S^T q, because
//   S'^T k = e^g (S^T k)   and   S^T q (new) = e^g (S^T q) + (k.q) delta,
// so each step needs a single cross-thread reduction.
//
// The kernel is a sequential scan (the recurrent form) for all three ops:
// each block owns a [d_k x 32] column slice of one (sequence, value head)
// state in registers, stages 16 time steps of q/k/v/g/beta in shared memory,
// then steps through them with one barrier per step. It is exact in the
// ordering sense (no chunked WY re-association), which is why the chunked
// torch reference is tested against the recurrent one rather than the kernel
// against a different algorithm. A tensor-core chunked kernel for long
// prefills is future work; see the op module.
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

#include <cmath>
#include <limits>
#include <tuple>

#include "common.cuh"
#include "dispatch.cuh"

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
    if (threadIdx.x < steps) {
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

// Checks shared by the three ops; q may be undefined (state-only). Shapes are
// the sequence form: q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv].
void check_gdn_args(const char* name, const at::Tensor* q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& g, const at::Tensor& beta, const c10::optional<at::Tensor>& state) {
  TORCH_CHECK(k.is_cuda(), name, "k must be a CUDA tensor, got ", k.device());
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4, name, "k must be [B, T, Hk, Dk] and v [B, T, Hv, Dv], got ",
              k.sizes(), " and ", v.sizes());
  const int64_t B = k.size(0), T = k.size(1), Hk = k.size(2), Dk = k.size(3);
  const int64_t Hv = v.size(2), Dv = v.size(3);
  if (q != nullptr) {
    TORCH_CHECK(q->sizes() == k.sizes(), name, "q and k shapes differ: ", q->sizes(), " vs ", k.sizes());
    TORCH_CHECK(q->scalar_type() == k.scalar_type() && q->device() == k.device(), name,
                "q and k must share dtype and device");
  }
  TORCH_CHECK(v.size(0) == B && v.size(1) == T, name, "v must share B and T with k");
  TORCH_CHECK(Hk > 0 && Hv % Hk == 0, name, "value heads (", Hv, ") must be a multiple of key heads (", Hk,
              ")");
  TORCH_CHECK(Dk >= 1 && Dk <= kGdnMaxKeyDim, name, "key head dim must be in [1, ", kGdnMaxKeyDim, "], got ",
              Dk);
  const auto dtype = k.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, name,
              "unsupported dtype ", dtype);
  TORCH_CHECK(v.scalar_type() == dtype && v.device() == k.device(), name, "v must share dtype/device with k");
  for (const at::Tensor* t : {&g, &beta}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == B && t->size(1) == T && t->size(2) == Hv, name,
                "g and beta must be [B, T, Hv] = [", B, ", ", T, ", ", Hv, "], got ", t->sizes());
    TORCH_CHECK(at::isFloatingType(t->scalar_type()) && t->device() == k.device(), name,
                "g and beta must be floating tensors on ", k.device());
  }
  if (state.has_value()) {
    TORCH_CHECK(state->scalar_type() == at::kFloat && state->device() == k.device(), name,
                "the state must be float32 on ", k.device());
    TORCH_CHECK(state->dim() == 4 && state->size(0) == B && state->size(1) == Hv && state->size(2) == Dk &&
                    state->size(3) == Dv,
                name, "the state must be [B, Hv, Dk, Dv] = [", B, ", ", Hv, ", ", Dk, ", ", Dv, "], got ",
                state->sizes());
  }
  TORCH_CHECK(T <= std::numeric_limits<int32_t>::max() && B <= 65535 && Hv <= 65535, name,
              "too large for one launch");
}

// Runs the scan; returns (out or undefined, final_state).
std::tuple<at::Tensor, at::Tensor> run_scan(const at::Tensor* q, const at::Tensor& k, const at::Tensor& v,
                                            const at::Tensor& g, const at::Tensor& beta,
                                            const c10::optional<at::Tensor>& initial_state, bool l2norm) {
  const int64_t B = k.size(0), T = k.size(1), Hk = k.size(2), Dk = k.size(3);
  const int64_t Hv = v.size(2), Dv = v.size(3);
  const c10::cuda::CUDAGuard device_guard(k.device());
  at::Tensor out;
  if (q != nullptr) out = at::empty({B, T, Hv, Dv}, q->options());
  at::Tensor final_state = at::empty({B, Hv, Dk, Dv}, k.options().dtype(at::kFloat));
  if (final_state.numel() == 0) return {out, final_state};
  if (T == 0) {  // nothing to scan: the state passes through unchanged
    if (initial_state.has_value()) {
      final_state.copy_(*initial_state);
    } else {
      final_state.zero_();
    }
    return {out, final_state};
  }
  const at::Tensor kc = k.contiguous();
  const at::Tensor vc = v.contiguous();
  const at::Tensor qc = q != nullptr ? q->contiguous() : at::Tensor();
  const at::Tensor gc = g.to(at::kFloat).contiguous();
  const at::Tensor bc = beta.to(at::kFloat).contiguous();
  const at::Tensor sc = initial_state.has_value() ? initial_state->contiguous() : at::Tensor();
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(Dk));
  const dim3 grid(static_cast<unsigned>(ceil_div<int64_t>(Dv, kGdnCols)), static_cast<unsigned>(Hv),
                  static_cast<unsigned>(B));
  const auto stream = c10::cuda::getCurrentCUDAStream();

  RIDGEFILL_DISPATCH_FLOAT_TYPES(k.scalar_type(), "gdn_scan", [&] {
    auto launch = [&](auto rows_tag) {
      constexpr int kRows = decltype(rows_tag)::value;
      const float* init = sc.defined() ? sc.const_data_ptr<float>() : nullptr;
      if (q != nullptr) {
        gdn_scan_kernel<scalar_t, kRows, true><<<grid, kGdnThreads, 0, stream>>>(
            out.data_ptr<scalar_t>(), final_state.data_ptr<float>(), qc.const_data_ptr<scalar_t>(),
            kc.const_data_ptr<scalar_t>(), vc.const_data_ptr<scalar_t>(), gc.const_data_ptr<float>(),
            bc.const_data_ptr<float>(), init, static_cast<int>(T), static_cast<int>(Hk), static_cast<int>(Hv),
            static_cast<int>(Dk), static_cast<int>(Dv), l2norm, q_scale);
      } else {
        gdn_scan_kernel<scalar_t, kRows, false><<<grid, kGdnThreads, 0, stream>>>(
            nullptr, final_state.data_ptr<float>(), nullptr, kc.const_data_ptr<scalar_t>(),
            vc.const_data_ptr<scalar_t>(), gc.const_data_ptr<float>(), bc.const_data_ptr<float>(), init,
            static_cast<int>(T), static_cast<int>(Hk), static_cast<int>(Hv), static_cast<int>(Dk),
            static_cast<int>(Dv), l2norm, q_scale);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    // State rows per thread = ceil(Dk / 4), bucketed to bound instantiations.
    if (Dk <= 64) {
      launch(std::integral_constant<int, 16>{});
    } else if (Dk <= 128) {
      launch(std::integral_constant<int, 32>{});
    } else {
      launch(std::integral_constant<int, 64>{});
    }
  });
  return {out, final_state};
}

std::tuple<at::Tensor, at::Tensor> gdn_chunk_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& g, const at::Tensor& beta,
                                                  const c10::optional<at::Tensor>& initial_state,
                                                  bool use_qk_l2norm) {
  check_gdn_args("ridgefill::gdn_chunk: ", &q, k, v, g, beta, initial_state);
  return run_scan(&q, k, v, g, beta, initial_state, use_qk_l2norm);
}

// One token per sequence: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv],
// state [B, Hv, Dk, Dv] -> (o [B, Hv, Dv], new state).
std::tuple<at::Tensor, at::Tensor> gdn_step_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const at::Tensor& g, const at::Tensor& beta,
                                                 const at::Tensor& state, bool use_qk_l2norm) {
  constexpr const char* kName = "ridgefill::gdn_step: ";
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && g.dim() == 2 && beta.dim() == 2, kName,
              "expected q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv]");
  const at::Tensor q4 = q.unsqueeze(1), k4 = k.unsqueeze(1), v4 = v.unsqueeze(1);
  const at::Tensor g3 = g.unsqueeze(1), b3 = beta.unsqueeze(1);
  const c10::optional<at::Tensor> st(state);
  check_gdn_args(kName, &q4, k4, v4, g3, b3, st);
  auto [out, final_state] = run_scan(&q4, k4, v4, g3, b3, st, use_qk_l2norm);
  return {out.squeeze(1), final_state};
}

at::Tensor gdn_state_update_cuda(const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                 const at::Tensor& beta, const c10::optional<at::Tensor>& initial_state,
                                 bool use_qk_l2norm) {
  check_gdn_args("ridgefill::gdn_state_update: ", nullptr, k, v, g, beta, initial_state);
  return std::get<1>(run_scan(nullptr, k, v, g, beta, initial_state, use_qk_l2norm));
}

}  // namespace
}  // namespace ridgefill

TORCH_LIBRARY_IMPL(ridgefill, CUDA, m) {
  m.impl("gdn_chunk", &ridgefill::gdn_chunk_cuda);
  m.impl("gdn_step", &ridgefill::gdn_step_cuda);
  m.impl("gdn_state_update", &ridgefill::gdn_state_update_cuda);
}
