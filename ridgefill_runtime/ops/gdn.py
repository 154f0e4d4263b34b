"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear-attention layers): chunk, step and state-only ops.

Convention (matches transformers' torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule,
tested against both): per value head, all in fp32,
    q_t, k_t <- l2norm(q_t), l2norm(k_t)          (optional; l2norm(x) = x * rsqrt(sum x^2 + 1e-6))
    q_t <- q_t / sqrt(d_k)
    S'  = exp(g_t) · S                            (g_t <= 0, log-space decay)
    S   = S' + β_t · k_t (v_t − S'ᵀ k_t)ᵀ          (S is [d_k, d_v])
    o_t = Sᵀ q_t                                  (the *updated* state)
Layouts: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; state float32 [B, Hv, Dk, Dv].
Value head h uses key head h // (Hv // Hk) (transformers' repeat_interleave grouping). Outputs o
[B, T, Hv, Dv] in q's dtype; states are float32.

Ops:
  gdn_chunk(q, k, v, g, beta, initial_state, use_qk_l2norm) -> (o, final_state)   prefill / exact rows
  gdn_step(q, k, v, g, beta, state, use_qk_l2norm) -> (o, new_state)             one decode token,
      q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv]
  gdn_state_update(k, v, g, beta, initial_state, use_qk_l2norm) -> final_state   filled rows (seed 000
      §2: a filled row still carries the state, but nobody reads its output)

References: `gdn_recurrent_reference` (one token at a time) and `gdn_chunk_reference` (the chunked form,
below); the CPU path of gdn_chunk uses the chunked one. The CUDA kernel (csrc/gdn.cu) is a fused
sequential scan for all three ops; a tensor-core chunked kernel for long prefills is future work.

Chunked form (our derivation; C tokens per chunk, S0 the state entering the chunk, γ_i = Σ_{s<=i} g_s):
    S_i = e^{γ_i} S0 + Σ_{s<=i} e^{γ_i−γ_s} k_s δ_sᵀ,     δ_i = β_i (v_i − e^{g_i} S_{i−1}ᵀ k_i)
  so the δ's solve a unit-lower-triangular system
    δ_i + β_i Σ_{s<i} e^{γ_i−γ_s} (k_i·k_s) δ_s = β_i (v_i − e^{γ_i} S0ᵀ k_i),
  then o_i = e^{γ_i} S0ᵀ q_i + Σ_{s<=i} e^{γ_i−γ_s} (q_i·k_s) δ_s and S_C = e^{γ_C} S0 + Σ_s e^{γ_C−γ_s} k_s δ_sᵀ.
  All exponents are γ_i − γ_s <= 0 for s <= i (g <= 0), so nothing overflows.
"""

from __future__ import annotations


import torch

from .extension import op_available

_L2_EPS = 1e-6  # transformers' (and FLA's) l2norm epsilon
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_CHUNK = 64


def _check_seq_args(name, q, k, v, g, beta, state) -> None:
    """Contract of the sequence-form ops (q may be None for the state-only op)."""
    if k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{name}: need k [B, T, Hk, Dk] and v [B, T, Hv, Dv], got {tuple(k.shape)}, {tuple(v.shape)}")
    batch, seq_len, k_heads, k_dim = k.shape
    v_heads, v_dim = v.shape[2], v.shape[3]
    if q is not None and (q.shape != k.shape or q.dtype != k.dtype):
        raise ValueError(f"{name}: q must match k in shape and dtype, got {tuple(q.shape)} {q.dtype}")
    if k.dtype not in _DTYPES or v.dtype != k.dtype:
        raise TypeError(f"{name}: q, k, v must share a float dtype (float32, bfloat16, float16)")
    if tuple(v.shape[:2]) != (batch, seq_len) or k_heads == 0 or v_heads % k_heads:
        raise ValueError(f"{name}: v must share B, T with k and Hv ({v_heads}) must be a multiple of Hk ({k_heads})")
    if not 1 <= k_dim <= 256:
        raise ValueError(f"{name}: key head dim must be in [1, 256], got {k_dim}")
    for t, what in ((g, "g"), (beta, "beta")):
        if tuple(t.shape) != (batch, seq_len, v_heads) or not t.dtype.is_floating_point:
            raise ValueError(
                f"{name}: {what} must be a float [B, T, Hv] = {(batch, seq_len, v_heads)}, got {tuple(t.shape)}"
            )
    if state is not None and (state.dtype != torch.float32 or tuple(state.shape) != (batch, v_heads, k_dim, v_dim)):
        raise ValueError(
            f"{name}: the state must be float32 [B, Hv, Dk, Dv] = {(batch, v_heads, k_dim, v_dim)}, "
            f"got {state.dtype} {tuple(state.shape)}"
        )


def _prepare(q, k, v, g, beta, use_qk_l2norm):
    """fp32, heads first ([B, Hv, T, D]), key heads expanded to value heads, q normalised and scaled."""
    groups = v.shape[2] // k.shape[2]
    k = k.float().repeat_interleave(groups, dim=2).transpose(1, 2)  # [B, Hv, T, Dk]
    if use_qk_l2norm:
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + _L2_EPS)
    if q is not None:
        q = q.float().repeat_interleave(groups, dim=2).transpose(1, 2)  # [B, Hv, T, Dk]
        if use_qk_l2norm:
            q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + _L2_EPS)
        q = q * k.shape[-1] ** -0.5
    v = v.float().transpose(1, 2)  # [B, Hv, T, Dv]
    g = g.float().transpose(1, 2)  # [B, Hv, T]
    beta = beta.float().transpose(1, 2)  # [B, Hv, T]
    return q, k, v, g, beta


def _zero_state(k, v):
    return torch.zeros(k.shape[0], v.shape[2], k.shape[3], v.shape[3], dtype=torch.float32, device=k.device)


def gdn_recurrent_reference(q, k, v, g, beta, initial_state=None, use_qk_l2norm=False):
    """One token at a time. q may be None (then o is None). Returns (o [B, T, Hv, Dv] | None, state)."""
    _check_seq_args("gdn_recurrent_reference", q, k, v, g, beta, initial_state)
    out_dtype = k.dtype
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta, use_qk_l2norm)
    state = _zero_state(k, v) if initial_state is None else initial_state.float().clone()  # [B, Hv, Dk, Dv]
    outs = []
    for t in range(kf.shape[2]):
        state = state * gf[:, :, t, None, None].exp()
        kt = kf[:, :, t]  # [B, Hv, Dk]
        delta = (vf[:, :, t] - torch.einsum("bhkv,bhk->bhv", state, kt)) * bf[:, :, t, None]  # [B, Hv, Dv]
        state = state + kt[..., None] * delta[:, :, None, :]
        if qf is not None:
            outs.append(torch.einsum("bhkv,bhk->bhv", state, qf[:, :, t]))
    if qf is None:
        return None, state
    o = torch.stack(outs, dim=2) if outs else vf.new_zeros(vf.shape)  # [B, Hv, T, Dv]
    return o.transpose(1, 2).contiguous().to(out_dtype), state


def gdn_chunk_reference(q, k, v, g, beta, initial_state=None, use_qk_l2norm=False, chunk_size=DEFAULT_CHUNK):
    """The chunked form of the module docstring. q may be None. Returns (o | None, final_state)."""
    _check_seq_args("gdn_chunk_reference", q, k, v, g, beta, initial_state)
    out_dtype = k.dtype
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta, use_qk_l2norm)
    state = _zero_state(k, v) if initial_state is None else initial_state.float().clone()  # [B, Hv, Dk, Dv]
    seq_len = kf.shape[2]
    outs = []
    for c0 in range(0, seq_len, chunk_size):
        sl = slice(c0, min(c0 + chunk_size, seq_len))
        kc, vc, bc = kf[:, :, sl], vf[:, :, sl], bf[:, :, sl]  # [B, Hv, C, *]
        gamma = gf[:, :, sl].cumsum(-1)  # [B, Hv, C]
        n = gamma.shape[-1]
        lower = torch.ones(n, n, dtype=torch.bool, device=k.device).tril()  # s <= i
        # e^{γ_i − γ_s} for s <= i; masked before exp so the upper part cannot overflow.
        pair = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [B, Hv, C, C]
        strict = pair.masked_fill(lower & ~lower.tril(-1), 0.0)  # zero the diagonal: s < i
        a = bc[..., None] * strict * (kc @ kc.transpose(-1, -2))  # [B, Hv, C, C]
        eye = torch.eye(n, dtype=torch.float32, device=k.device)
        rhs = bc[..., None] * (vc - gamma.exp()[..., None] * (kc @ state))  # [B, Hv, C, Dv]
        delta = torch.linalg.solve_triangular(a + eye, rhs, upper=False, unitriangular=True)  # [B, Hv, C, Dv]
        if qf is not None:
            qc = qf[:, :, sl]
            outs.append(gamma.exp()[..., None] * (qc @ state) + (pair * (qc @ kc.transpose(-1, -2))) @ delta)
        last = gamma[..., -1:]  # [B, Hv, 1]
        state = last.exp()[..., None] * state + (kc * (last - gamma).exp()[..., None]).transpose(-1, -2) @ delta
    if qf is None:
        return None, state
    o = torch.cat(outs, dim=2) if outs else vf.new_zeros(vf.shape)  # [B, Hv, T, Dv]
    return o.transpose(1, 2).contiguous().to(out_dtype), state


def _step_to_seq(q, k, v, g, beta):
    return (None if q is None else q[:, None]), k[:, None], v[:, None], g[:, None], beta[:, None]


def gdn_step_reference(q, k, v, g, beta, state, use_qk_l2norm=False):
    """One token: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv] -> (o [B, Hv, Dv], new state)."""
    o, new_state = gdn_recurrent_reference(*_step_to_seq(q, k, v, g, beta), state, use_qk_l2norm)
    return o[:, 0], new_state


def gdn_state_update_reference(k, v, g, beta, initial_state=None, use_qk_l2norm=False):
    return gdn_chunk_reference(None, k, v, g, beta, initial_state, use_qk_l2norm)[1]


if op_available("gdn_chunk"):

    def _state_like(k, v):
        return k.new_empty((k.shape[0], v.shape[2], k.shape[3], v.shape[3]), dtype=torch.float32)

    @torch.library.register_fake("ridgefill::gdn_chunk")
    def _chunk_fake(q, k, v, g, beta, initial_state, use_qk_l2norm):
        _check_seq_args("gdn_chunk", q, k, v, g, beta, initial_state)
        return q.new_empty(v.shape), _state_like(k, v)

    @torch.library.register_kernel("ridgefill::gdn_chunk", "cpu")
    def _chunk_cpu(q, k, v, g, beta, initial_state, use_qk_l2norm):
        return gdn_chunk_reference(q, k, v, g, beta, initial_state, use_qk_l2norm)

    @torch.library.register_fake("ridgefill::gdn_step")
    def _step_fake(q, k, v, g, beta, state, use_qk_l2norm):
        _check_seq_args("gdn_step", *_step_to_seq(q, k, v, g, beta), state)
        return q.new_empty(v.shape), _state_like(k[:, None], v[:, None])

    @torch.library.register_kernel("ridgefill::gdn_step", "cpu")
    def _step_cpu(q, k, v, g, beta, state, use_qk_l2norm):
        return gdn_step_reference(q, k, v, g, beta, state, use_qk_l2norm)

    @torch.library.register_fake("ridgefill::gdn_state_update")
    def _update_fake(k, v, g, beta, initial_state, use_qk_l2norm):
        _check_seq_args("gdn_state_update", None, k, v, g, beta, initial_state)
        return _state_like(k, v)

    @torch.library.register_kernel("ridgefill::gdn_state_update", "cpu")
    def _update_cpu(k, v, g, beta, initial_state, use_qk_l2norm):
        return gdn_state_update_reference(k, v, g, beta, initial_state, use_qk_l2norm)

    _chunk_impl = torch.ops.ridgefill.gdn_chunk.default
    _step_impl = torch.ops.ridgefill.gdn_step.default
    _update_impl = torch.ops.ridgefill.gdn_state_update.default
else:
    _chunk_impl = gdn_chunk_reference
    _step_impl = gdn_step_reference
    _update_impl = gdn_state_update_reference


def gdn_chunk(q, k, v, g, beta, initial_state=None, use_qk_l2norm=False):
    """(o [B, T, Hv, Dv], final_state [B, Hv, Dk, Dv] fp32) over T tokens; see the module docstring."""
    if k.is_cuda:
        return _chunk_impl(q, k, v, g, beta, initial_state, use_qk_l2norm)
    return gdn_chunk_reference(q, k, v, g, beta, initial_state, use_qk_l2norm)


def gdn_step(q, k, v, g, beta, state, use_qk_l2norm=False):
    """One decode token per sequence -> (o [B, Hv, Dv], new_state)."""
    if k.is_cuda:
        return _step_impl(q, k, v, g, beta, state, use_qk_l2norm)
    return gdn_step_reference(q, k, v, g, beta, state, use_qk_l2norm)


def gdn_state_update(k, v, g, beta, initial_state=None, use_qk_l2norm=False):
    """Final state only (filled rows: no output is read)."""
    if k.is_cuda:
        return _update_impl(k, v, g, beta, initial_state, use_qk_l2norm)
    return gdn_state_update_reference(k, v, g, beta, initial_state, use_qk_l2norm)
