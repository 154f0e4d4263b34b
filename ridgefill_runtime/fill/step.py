"""What one engine step asks of the fill: which rows stop at the split, which are filled, which
join the late layers from the stash, and what attention to record. Built by the runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable

import torch

from ..layers.attention import AttentionBatch

Predictor = Callable[[int, torch.Tensor], torch.Tensor]  # (late layer, x_S [F, d]) -> x̂ [F, d]


@dataclass
class Rescale:
    """Per-KV-head norm correction (seed 000, §2.3): measured on some exact late rows,
    applied to one sequence's filled slots before anything reads them."""

    rows: torch.Tensor  # [c] indices into the late part: the sequence's first exact late rows
    filled_slots: torch.Tensor  # [P] the sequence's filled prefix slots
    values: bool
    keys: bool


@dataclass
class MassRequest:
    """Measure the attention some rows pay to a sequence's keys (seed 000, §2.4): at `layers`,
    rows `rows` of the part (positions q_pos) read keys at key_pos from key_slots. The model
    returns what each key receives (ForwardOutput); the runner adds the prefix keys' share into
    the sequence's stash."""

    layers: frozenset[int]
    rows: torch.Tensor  # [R] indices into the part's rows
    q_pos: torch.Tensor  # [R]
    key_slots: torch.Tensor  # [K]
    key_pos: torch.Tensor  # [K] sorted


@dataclass
class FillStep:
    """A step's rows run in two parts. The lower part (ids passed to the model) runs layers
    below the split; at the split its `exit_rows` stop (their states come back in the model's
    ForwardOutput.split_states), `fill_rows` among them write predicted late K/V, and
    `stay_rows` continue. The late part is stay rows plus `late_x` (split states of probe /
    exact / tail rows from earlier steps)."""

    split: int
    exit_rows: torch.Tensor  # [X] lower-part rows that stop at the split
    fill_rows: torch.Tensor  # [F] lower-part rows whose late K/V are predicted
    fill_slots: torch.Tensor  # [F]
    predict: Predictor | None  # None: nofill writes no late K/V
    stay_rows: torch.Tensor  # [S] lower-part rows that run every layer
    stay_to: torch.Tensor  # [S] their index in the late part
    late_x: torch.Tensor  # [M2, d] split states joining at the split
    late_pos: torch.Tensor  # [M2] their positions
    late_to: torch.Tensor  # [M2] their index in the late part
    late_size: int  # M = S + M2
    late_batch: AttentionBatch  # attention layout of the late part
    lower_mass: list[MassRequest] = field(default_factory=list)  # rows index the lower part
    late_mass: list[MassRequest] = field(default_factory=list)  # rows index the late part
    rescales: list[Rescale] = field(default_factory=list)
    # Hybrids (seed 000 §2.4 "Two sweeps"): late-part rows that are filled prefix rows. They
    # update the late recurrent states from x̂_l and nothing else; the rows that attend and run
    # the MLP are `late_exact` [E] (indices into the late part) laid out as `late_exact_batch`.
    late_filled: torch.Tensor | None = None  # [M] bool; None: no filled row in the late part
    late_exact: torch.Tensor | None = None  # [E]
    late_exact_batch: AttentionBatch | None = None
    # late_batch sequences whose rows this step end at their prefix's end (the terminal-state
    # correction is added to their late recurrent states there)
    prefix_ends: list[int] = field(default_factory=list)
    # the terminal-state correction's ΔM of a late recurrent layer ([Hv, Dk, Dv]); None: off
    terminal_shift: Callable[[int], torch.Tensor] | None = None
    # Sliding-window late layers: a filled row's K/V there is written only once a later row
    # reaches it (less than `window` positions after it). Then fill_rows skip those layers and
    # these rows, from the stash, are written there this step (fill/plan.py).
    defer_windows: bool = False
    window_x: torch.Tensor | None = None  # [W, d] their split states
    window_pos: torch.Tensor | None = None  # [W]
    window_slots: torch.Tensor | None = None  # [W]
