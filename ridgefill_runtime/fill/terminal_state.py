"""The terminal-state correction for filled Gated DeltaNet layers (seed 000 §2.3, Appendix H).

At the end of the prefix, each late GDN layer's state gets ρ_l·ΔM_l added once:
  ΔM_l  [Hv, Dk, Dv] the mean difference exact − filled between the layer's state after a fully
        exact and after a fully filled prefix, measured every `every` tokens on calibration
        prompts (terminal_fit.py);
  ρ_l   [Hv] the filled rows' share of the state's weight: with gates γ_t = exp(g_t), row j's
        weight at the prefix end n is w_j = Π_{k=j+1..n} γ_k, and ρ = Σ_filled w_j / Σ_j w_j.

ρ is carried per sequence as two running sums (all rows, filled rows) that a chunk of rows with
log-gates g updates as A ← A·exp(Σg) + Σ_j exp(G_end − G_j), G the chunk's running sum of g. The
Gated DeltaNet mixer carries them with its state (layers/gated_deltanet.py's share_update), as it
alone sees the gates.
"""

from __future__ import annotations

import torch

from .step import TerminalCorrection


def filled_share(share: torch.Tensor) -> torch.Tensor:
    """ρ [Hv] from the running sums [2, Hv]."""
    return share[1] / share[0].clamp_min(torch.finfo(share.dtype).tiny)


def correct_state(state: torch.Tensor, rho: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """state [Hv, Dk, Dv] + ρ [Hv] · ΔM [Hv, Dk, Dv]."""
    return state + rho[:, None, None].to(state.dtype) * shift.to(state.dtype)


def correct_terminal_states(c: TerminalCorrection, layer: int, state: dict[str, torch.Tensor], slots) -> None:
    """At the prefix's end: S += ρ·ΔM in `layer`'s state (parts "ssm" [slots, Hv, Dk, Dv] and
    "share" [slots, 2, Hv]) of each of c.prefix_ends, ρ from the sums the mixer just carried.
    slots: the late part's state slot of each of its sequences."""
    shift = c.shift(layer)  # [Hv, Dk, Dv]
    for k in c.prefix_ends:
        slot = slots[k]
        state["ssm"][slot] = correct_state(state["ssm"][slot], filled_share(state["share"][slot]), shift)
