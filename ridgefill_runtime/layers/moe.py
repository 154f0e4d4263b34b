"""Sparse mixture-of-experts MLP with a gated shared expert (Qwen3-Next).

Per token: router probabilities softmax(W_r x) in float32; the top_k experts, their weights
renormalised to sum to 1 when norm_topk_prob; out = Σ_e w_e · SwiGLU_e(x) + σ(w_s · x) · SwiGLU_s(x).
Tokens are grouped by expert so each expert runs one GEMM over the tokens routed to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .mlp import swiglu_mlp


@dataclass
class MoEWeights:
    router: torch.Tensor  # [E, d]
    gate_up: torch.Tensor  # [E, 2I, d]: per expert, gate rows then up rows
    down: torch.Tensor  # [E, d, I]
    shared_gate_up: torch.Tensor  # [2Is, d]
    shared_down: torch.Tensor  # [d, Is]
    shared_gate: torch.Tensor  # [1, d]


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """x [N, d] -> (weights [N, k] in x's dtype, experts [N, k] int64)."""
    probs = F.linear(x, router).softmax(dim=-1, dtype=torch.float32)  # [N, E]
    weights, experts = probs.topk(top_k, dim=-1)  # [N, k]
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(x.dtype), experts


def sparse_moe(x: torch.Tensor, w: MoEWeights, top_k: int, norm_topk_prob: bool) -> torch.Tensor:
    """x [N, d] -> [N, d]."""
    weights, experts = route(x, w.router, top_k, norm_topk_prob)
    out = torch.zeros_like(x)
    flat = experts.flatten()  # [N*k]
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=w.router.shape[0]).tolist()
    tokens = order // top_k  # [N*k] token of each (token, choice) pair, grouped by expert
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        pick = order[start : start + count]
        rows = tokens[start : start + count]
        y = swiglu_mlp(x[rows], w.gate_up[e], w.down[e])  # [count, d]
        out.index_add_(0, rows, y * weights.flatten()[pick, None])
        start += count
    shared = swiglu_mlp(x, w.shared_gate_up, w.shared_down)
    return out + torch.sigmoid(F.linear(x, w.shared_gate)) * shared
