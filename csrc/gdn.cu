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
#include "gdn_kernels.cuh"
#include "dispatch.cuh"

namespace ridgefill {
namespace {

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
