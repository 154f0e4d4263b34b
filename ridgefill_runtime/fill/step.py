"""What one engine step asks of the fill (fill/two_sweep.py runs it): which rows stop at the split,
which are filled, which join the late layers from the stash, what to correct and what attention to
record. Built by the runner (fill/plan.py).

A FillStep is a few named parts: the lower part (rows passed to the model, run below the split),
the late part (rows run from the split on), and, where they apply, the hybrids' filled late rows,
the terminal-state correction and the sliding-window writes deferred to the rows that reach them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..layers.attention import AttentionBatch

Predictor = Callable[[int, torch.Tensor], torch.Tensor]  # (late layer, x_S [F, d]) -> x̂ [F, d]


@dataclass(frozen=True)
class Rescale:
    """Per-KV-head norm correction (seed 000, §2.3): measured on some exact late rows,
    applied to one sequence's filled slots before anything reads them."""

    rows: torch.Tensor  # [c] indices into the late part: the sequence's first exact late rows
    filled_slots: torch.Tensor  # [P] the sequence's filled prefix slots
    values: bool
    keys: bool

    def __post_init__(self):
        if not (self.values or self.keys):
            raise ValueError("a Rescale corrects values, keys or both")


@dataclass(frozen=True)
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

    def __post_init__(self):
        if len(self.rows) != len(self.q_pos) or len(self.key_slots) != len(self.key_pos):
            raise ValueError("a MassRequest needs one position per row and one per key")


@dataclass(frozen=True)
class LowerPart:
    """The rows whose ids the model is given: they run the layers below the split. There
    `exit_rows` stop (their states come back in ForwardOutput.split_states), `fill_rows` among
    them write predicted late K/V, and `stay_rows` go on through every layer."""

    exit_rows: torch.Tensor  # [X]
    fill_rows: torch.Tensor  # [F]
    fill_slots: torch.Tensor  # [F] their cache slots
    stay_rows: torch.Tensor  # [S]
    mass: tuple[MassRequest, ...] = ()  # rows index the lower part

    def __post_init__(self):
        if len(self.fill_rows) != len(self.fill_slots):
            raise ValueError("every filled row needs its cache slot")


@dataclass(frozen=True)
class LatePart:
    """The rows that run the layers from the split on: the lower part's stay rows and the split
    states of probe / exact / tail rows stashed by earlier steps (`x`), `size` rows in all."""

    size: int  # M = S + M2
    batch: AttentionBatch  # attention layout of the M rows
    stay_to: torch.Tensor  # [S] the stay rows' index in the late part
    x: torch.Tensor  # [M2, d] split states joining at the split
    pos: torch.Tensor  # [M2] their positions
    to: torch.Tensor  # [M2] their index in the late part
    mass: tuple[MassRequest, ...] = ()  # rows index the late part
    rescales: tuple[Rescale, ...] = ()

    def __post_init__(self):
        if not self.x.shape[0] == len(self.pos) == len(self.to):
            raise ValueError("every joining split state needs its position and late-part index")
        if self.size != len(self.stay_to) + len(self.to):
            raise ValueError(f"a late part of {self.size} rows is its stay rows and its joining rows")


@dataclass(frozen=True)
class FilledLateRows:
    """Hybrids (seed 000 §2.4 "Two sweeps"): late-part rows that are filled prefix rows. They
    update the late recurrent states from x̂_l and nothing else; the rows that attend and run the
    MLP are `exact` (indices into the late part) laid out as `exact_batch`."""

    filled: torch.Tensor  # [M] bool
    exact: torch.Tensor  # [E]
    exact_batch: AttentionBatch


@dataclass(frozen=True)
class TerminalCorrection:
    """The terminal-state correction (fill/terminal_state.py): at the prefix's end each late
    recurrent layer's state gets ρ·ΔM added."""

    shift: Callable[[int], torch.Tensor]  # late recurrent layer -> its ΔM [Hv, Dk, Dv]
    prefix_ends: tuple[int, ...]  # late-part sequences whose rows this step end at their prefix's end


@dataclass(frozen=True)
class WindowWrites:
    """Sliding-window late layers: a filled row's K/V there is written only once a later row reaches
    it (less than `window` positions after it). The lower part's fill rows then skip those layers,
    and these rows, from the stash, are written there this step (fill/plan.py)."""

    x: torch.Tensor  # [W, d] their split states
    pos: torch.Tensor  # [W]
    slots: torch.Tensor  # [W]

    def __post_init__(self):
        if not self.x.shape[0] == len(self.pos) == len(self.slots):
            raise ValueError("every deferred window row needs its position and cache slot")


@dataclass(frozen=True)
class FillStep:
    """A step's rows run in two parts, `lower` below the split and `late` from it on."""

    split: int
    predict: Predictor | None  # None: nofill writes no late K/V
    lower: LowerPart
    late: LatePart
    filled_late: FilledLateRows | None = None  # None: no filled row in the late part
    terminal: TerminalCorrection | None = None  # None: the correction is off
    windows: WindowWrites | None = None  # None: filled rows write every late layer at once

    def __post_init__(self):
        if self.split < 1:
            raise ValueError(f"the split is a layer >= 1, got {self.split}")
        if len(self.lower.stay_rows) != len(self.late.stay_to):
            raise ValueError("every stay row needs its late-part index")
        if self.filled_late is not None and self.filled_late.filled.shape[0] != self.late.size:
            raise ValueError("the filled-row mask covers the late part")
