"""What one engine step asks of the fill: which rows are filled and how. Built by the runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..layers.attention import AttentionBatch

Predictor = Callable[[int, torch.Tensor], torch.Tensor]  # (late layer, x_S [F, d]) -> x̂ [F, d]


@dataclass
class Rescale:
    """Per-KV-head norm correction (seed 000, §2.3): measured on some exact late rows,
    applied to one sequence's filled slots before anything reads them."""

    rows: torch.Tensor  # [c] indices into FillStep.late_rows: the first tail rows
    filled_slots: torch.Tensor  # [P] the sequence's filled prefix slots
    values: bool
    keys: bool


@dataclass
class FillStep:
    split: int
    rows: torch.Tensor  # [F] step rows that are filled prefix rows (sorted)
    slots: torch.Tensor  # [F] their cache slots
    predict: Predictor | None  # None: the nofill arm writes no late K/V
    late_rows: torch.Tensor  # [M] step rows that run every layer (sorted)
    late_batch: AttentionBatch  # attention layout of late_rows in layers >= split
    rescales: list[Rescale] = field(default_factory=list)
