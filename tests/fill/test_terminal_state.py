"""The terminal-state correction's scale ρ and its cancellation (seed 000 Appendix H), on
explicit float64 loops and the erase-free state model M_t = γ_t M_{t-1} + u_t."""

from __future__ import annotations

import pytest
import torch

from ridgefill_runtime.fill.terminal_state import correct_state, filled_share
from ridgefill_runtime.layers.gated_deltanet import share_update

HEADS, N = 3, 40


def log_gates(seed: int, near_one: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    low = -0.02 if near_one else -1.0
    return torch.empty(N, HEADS, dtype=torch.float64).uniform_(low, -0.001, generator=g)  # [N, Hv]


def loop_share(g: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:
    """ρ by its definition: w_j = Π_{k=j+1..n} γ_k; ρ = Σ_filled w_j / Σ_j w_j."""
    rho = []
    for h in range(g.shape[1]):
        weights = []
        for j in range(g.shape[0]):
            w = 1.0
            for k in range(j + 1, g.shape[0]):
                w *= float(torch.exp(g[k, h]))
            weights.append(w)
        rho.append(sum(w for w, f in zip(weights, filled) if f) / sum(weights))
    return torch.tensor(rho, dtype=torch.float64)


def filled_rows(seed: int) -> torch.Tensor:
    mask = torch.rand(N, generator=torch.Generator().manual_seed(seed)) < 0.7
    mask[-5:] = False  # exact rows at the end of the prefix too
    return mask


@pytest.mark.parametrize("chunks", [(N,), (7, 1, 20, 12), (1,) * N])
def test_rho_carried_in_chunks_equals_the_float64_loop(chunks):
    g, filled = log_gates(0), filled_rows(1)
    share = torch.zeros(2, HEADS, dtype=torch.float32)
    start = 0
    for n in chunks:
        share = share_update(share, g[start : start + n].float(), filled[start : start + n])
        start += n
    assert torch.allclose(filled_share(share).double(), loop_share(g, filled), rtol=1e-5, atol=1e-6)


def erase_free_states(g: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
    """M_n of M_t = exp(g_t) M_{t-1} + u_t from M_0 = 0, float64 [Hv, a, b]."""
    m = torch.zeros_like(updates[0])
    for t in range(updates.shape[0]):
        m = torch.exp(g[t])[:, None, None] * m + updates[t]
    return m


@pytest.mark.parametrize("near_one", [False, True])
def test_rho_scaled_correction_cancels_a_constant_shift_exactly_and_no_other_scale_does(near_one):
    """The fill shifts every filled row's update by δ. ΔM is what a fully filled prefix is off
    by (δ Σ_j w_j); ρ·ΔM removes the shift of the partly filled prefix exactly, in the final
    state after an exact tail too; the unscaled correction and other scales do not."""
    g, filled = log_gates(2, near_one), filled_rows(3)
    gen = torch.Generator().manual_seed(4)
    updates = torch.randn(N, HEADS, 4, 5, dtype=torch.float64, generator=gen)
    delta = torch.randn(HEADS, 4, 5, dtype=torch.float64, generator=gen)
    exact = erase_free_states(g, updates)
    shifted = erase_free_states(g, updates + filled[:, None, None, None] * delta)
    shift_full = exact - erase_free_states(g, updates + delta)  # ΔM = exact − filled, every row filled
    share = share_update(torch.zeros(2, HEADS, dtype=torch.float64), g, filled)
    rho = filled_share(share)
    assert torch.allclose(correct_state(shifted, rho, shift_full), exact, atol=1e-6)
    for wrong in (torch.ones_like(rho), 0.5 * rho, rho**2, torch.full_like(rho, float(rho.mean()))):
        assert (correct_state(shifted, wrong, shift_full) - exact).abs().max() > 1e-3
    # an exact tail after the corrected prefix: its gates fade correction and error alike
    tail_g, tail_u = log_gates(5)[:11], torch.randn(10, HEADS, 4, 5, dtype=torch.float64, generator=gen)
    after = lambda m: erase_free_states(tail_g, torch.cat([m[None], tail_u]))  # noqa: E731
    assert torch.allclose(after(correct_state(shifted, rho, shift_full)), after(exact), atol=1e-6)
