"""The terminal-state correction for filled Gated DeltaNet layers (seed 000 §2.3, Appendix H).

At the end of the prefix, each late GDN layer's state gets ρ_l·ΔM_l added once:
  ΔM_l  [Hv, Dk, Dv] the mean difference exact − filled between the layer's state after a fully
        exact and after a fully filled prefix, measured every `every` tokens on calibration
        prompts (terminal_fit.py);
  ρ_l   [Hv] the filled rows' share of the state's weight: with gates γ_t = exp(g_t), row j's
        weight at the prefix end n is w_j = Π_{k=j+1..n} γ_k, and ρ = Σ_filled w_j / Σ_j w_j.

ρ is carried per sequence as two running sums (all rows, filled rows) that a chunk of rows with
log-gates g updates as A ← A·exp(Σg) + Σ_j exp(G_end − G_j), G the chunk's running sum of g.
"""

from __future__ import annotations

import torch


def share_update(share: torch.Tensor, g: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:
    """share [2, Hv] (Σ_j w_j over all rows so far, over filled rows) after rows with log-gates
    g [n, Hv] (each <= 0), filled [n] bool -> the new share [2, Hv]. float32 in, float32 out;
    the sums are formed in float64."""
    g64 = g.double()
    cum = g64.cumsum(0)  # [n, Hv]
    weights = (cum[-1:] - cum).exp()  # [n, Hv]: the gates after each row, to the chunk's end
    decay = cum[-1].exp()  # [Hv]
    new_all = share[0].double() * decay + weights.sum(0)
    new_filled = share[1].double() * decay + (weights * filled[:, None].double()).sum(0)
    return torch.stack([new_all, new_filled]).to(share.dtype)


def filled_share(share: torch.Tensor) -> torch.Tensor:
    """ρ [Hv] from the running sums [2, Hv]."""
    return share[1] / share[0].clamp_min(torch.finfo(share.dtype).tiny)


def correct_state(state: torch.Tensor, rho: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """state [Hv, Dk, Dv] + ρ [Hv] · ΔM [Hv, Dk, Dv]."""
    return state + rho[:, None, None].to(state.dtype) * shift.to(state.dtype)
