"""The runner <-> model boundary: one ForwardBatch in, one ForwardOutput out.

The runner builds the batch (rows, positions, attention layout, the step's fill plan, the caches);
the model writes K/V and recurrent states into the caches it is given (it owns their layout) and
returns everything else: logits, the split states of rows leaving at the fill's split, and the
attention the selectors score prefix rows by. It writes into no other runner-owned tensor: the
runner itself stores split states and scores in each sequence's stash.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers.attention import AttentionBatch


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [N] int64: the rows that start at layer 0 (with a fill step, its lower part)
    positions: torch.Tensor  # [N] int64
    attention: AttentionBatch  # layout of those N rows
    caches: object  # the runner's ModelCaches (a KVPool for the hand-driven tests)
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


def run_model(model, batch: ForwardBatch) -> ForwardOutput:
    """The model's exact forward over `batch`: its `run` where it has one, else the tensor-level
    forward (ids, positions, attention, caches, logit rows -> logits). NOTE: a step with a fill
    plan runs through fill/two_sweep.py instead, which calls the model's pieces itself."""
    if batch.fill is not None:
        raise ValueError("a two-sweep prefill step runs through fill/two_sweep.py, not run_model")
    run = getattr(model, "run", None)
    if run is not None:
        return run(batch)
    return ForwardOutput(
        model.forward(batch.input_ids, batch.positions, batch.attention, batch.caches, batch.logit_rows)
    )
