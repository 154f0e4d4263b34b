"""The runner <-> model boundary: one ForwardBatch in, one ForwardOutput out.

The runner builds the batch (rows, positions, attention layout, the step's fill plan, the caches);
the model writes K/V and recurrent states into the caches it is given (it owns their layout) and
returns everything else: logits, the split states of rows leaving at the fill's split, and the
attention the selectors score prefix rows by. It writes into no other runner-owned tensor: the
runner itself stores split states and scores in each sequence's stash.

LanguageModel declares that boundary from the model's side: every family answers `run`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..cache.build import ModelCaches
from ..cache.spec import CacheSpec
from ..config import ModelConfig
from ..layers.attention import AttentionBatch


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [N] int64: the rows that start at layer 0 (with a fill step, its lower part)
    positions: torch.Tensor  # [N] int64
    attention: AttentionBatch  # layout of those N rows
    caches: ModelCaches  # what build_caches made for the model
    # [R] sorted rows, among those reaching the top layer, that need logits; None: every one
    logit_rows: torch.Tensor | None = None
    # the two-sweep prefill's plan for this step (fill/step.py's FillStep), which fill/two_sweep.py
    # runs over the model's hooks (models/fill_hooks.py); None: the exact forward
    fill: object | None = None
    # looped models: per sequence, its loops and cache policy (layers/loop_attention.LoopRead);
    # None: every sequence runs the storage's own policy
    loops: tuple | None = None


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor  # [R, V] float32
    split_states: torch.Tensor | None = None  # [X, d] state at the split of fill.lower.exit_rows, in order
    # Per fill.lower.mass / fill.late.mass request, in order: the attention its key_pos received
    # at each of its layers, ascending ([K] float32 each). Kept per layer so the runner adds them
    # into the accumulators in the same order (and so the same float sums) as one pass would.
    lower_mass: tuple[tuple[torch.Tensor, ...], ...] = ()
    late_mass: tuple[tuple[torch.Tensor, ...], ...] = ()


class LanguageModel(Protocol):
    """What the engine needs of a model, whatever its family: one `run` per step, the caches it
    declares, and where it lives. Every family's model class (models/registry.py) is one."""

    config: ModelConfig
    dtype: torch.dtype  # what its weights and activations run in (its cache spec's dtype)
    device: torch.device

    def cache_spec(self) -> CacheSpec:
        """Per layer, what it keeps between steps (a looped model also takes the operator's
        LoopConfig: the planes to store; cache/spec.spec_of asks)."""
        ...

    def run(self, batch: ForwardBatch) -> ForwardOutput:
        """One step's forward: writes K/V and recurrent states into batch.caches, which it owns
        the layout of, and returns everything else."""
        ...
