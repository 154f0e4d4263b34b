"""Fitting the terminal-state correction's ΔM (seed 000 §2.3): per late Gated DeltaNet layer, the
mean gap between the state a fully exact and a fully filled prefix leave, every `every` tokens."""

from __future__ import annotations

import torch

from ..errors import InputError
from ..scheduler import ScheduledSeq
from ..sequence_driver import SequenceDriver
from .capture import document_driver, layer_inputs


@torch.inference_mode()
def fit_terminal_shift(
    model, maps, docs: list[list[int]], split: int, every: int = 2048
) -> tuple[dict[int, torch.Tensor], int]:
    """ΔM per late GDN layer: the mean, over every `every`-th position t of every document, of
    S_exact(t) − S_filled(t) (docs: token ids), the layer's state after t rows of true input and after t rows of
    x̂ = maps.predict(l, x_S) (a fully filled prefix, what ΔM stands for in Appendix H).
    Returns ({layer: ΔM [Hv, Dk, Dv] float32}, the number of states averaged)."""
    late = [l for l in range(split, model.config.num_layers) if model.config.family_config.is_linear(l)]
    sums: dict[int, torch.Tensor] = {}
    count = 0
    for ids in docs:
        if len(ids) < every:
            continue
        xs: dict[int, torch.Tensor] = {}

        def keep(layer: int, h: torch.Tensor) -> None:
            if layer == split or layer in late:
                xs[layer] = h

        drive = document_driver(model, ids)
        layer_inputs(model, drive, keep)
        for layer in late:
            exact = _states_every(model, drive, layer, xs[layer], every)
            filled = _states_every(model, drive, layer, maps.predict(layer, xs[split]), every)
            diff = (exact - filled).sum(0)  # [Hv, Dk, Dv]
            sums[layer] = diff if layer not in sums else sums[layer] + diff
        count += len(ids) // every
    if count == 0:
        raise InputError(f"no terminal-state prompt has {every} tokens: the fit has nothing to measure")
    return {layer: (s / count).float() for layer, s in sums.items()}, count


def _states_every(model, drive: SequenceDriver, layer: int, x: torch.Tensor, every: int) -> torch.Tensor:
    """Layer `layer`'s recurrent state after rows [0, t) of input x [n, d] (the driver's
    sequence's positions), for t = every, 2·every, ... -> [len(x) // every, Hv, Dk, Dv] (float64).
    NOTE: the layer runs from x, not from the layer below, in chunks of `every` rows over the
    driver's state slot; the first chunk, at position 0, starts it from zero. Its output (the MLP
    on top of the mixer) is not needed, only the state it leaves."""
    seq = drive.seq
    state = drive.caches.states.state(layer)
    out = []
    for start in range(0, len(x) - every + 1, every):
        _, positions, batch = drive.tensors(ScheduledSeq(seq, start, every))
        model.layer(layer, x[start : start + every], model.rope(positions), batch, drive.caches)
        out.append(state["ssm"][seq.state_slot].double().clone())
    return torch.stack(out)
