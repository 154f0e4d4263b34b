"""Per-sequence state the two-sweep prefill carries between steps: every row's split state x_S
(the late sweep and the probe start from it) and the selectors' attention accumulators. Runner-
owned: a two-sweep step (fill/two_sweep.py) returns split states and attention (ForwardOutput),
the runner writes them here.

Stashes live in the state pool (state_pool.py), one per state slot, and the cache manager frees
them with the slot: at the end of the prefill, at a preemption, at the end. NOTE: here, below the
fill, so that the pool can hold them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SplitStash:
    x: torch.Tensor  # [N, d] split state of each position (rows not yet run are garbage)
    attention: torch.Tensor  # [boundary] float32 lower-layer attention received
    probe: torch.Tensor  # [boundary] float32 late-layer attention received from the probe rows
    # [boundary] bool: filled rows whose K/V the sliding-window late layers hold (written when a
    # later row first reaches them, fill/plan.py); unused when the fill writes every row at once
    window_written: torch.Tensor | None = None

    @classmethod
    def new(cls, num_rows: int, width: int, boundary: int, dtype, device) -> SplitStash:
        # NOTE: x is N x d (9 MB at 4K tokens for SmolLM2; 256 MB at 32K for d = 4096 in bf16),
        # held only while the sequence is in its prefill.
        zeros = lambda: torch.zeros(boundary, dtype=torch.float32, device=device)  # noqa: E731
        return cls(
            torch.empty(num_rows, width, dtype=dtype, device=device),
            zeros(),
            zeros(),
            torch.zeros(boundary, dtype=torch.bool, device=device),
        )

    def nbytes(self) -> int:
        parts = (self.x, self.attention, self.probe, self.window_written)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)
