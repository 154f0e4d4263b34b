"""Fitting the terminal-state correction's ΔM (seed 000 §2.3): per late Gated DeltaNet layer, the
mean gap between the state a fully exact and a fully filled prefix leave, every `every` tokens."""

from __future__ import annotations

import torch

from ..cache.spec import RecurrentCache
from ..layers.attention import AttentionBatch
from ..layers.gated_deltanet import gdn_mixer, state_shapes
from ..layers.zero_centred_norm import zero_centred_rms_norm
from ..errors import InputError
from .capture import run_layer_inputs


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

        run_layer_inputs(model, ids, keep)
        for layer in late:
            exact = _states_every(model, layer, xs[layer], every)
            filled = _states_every(model, layer, maps.predict(layer, xs[split]), every)
            diff = (exact - filled).sum(0)  # [Hv, Dk, Dv]
            sums[layer] = diff if layer not in sums else sums[layer] + diff
        count += len(ids) // every
    if count == 0:
        raise InputError(f"no terminal-state prompt has {every} tokens: the fit has nothing to measure")
    return {layer: (s / count).float() for layer, s in sums.items()}, count


def _states_every(model, layer: int, x: torch.Tensor, every: int) -> torch.Tensor:
    """Layer `layer`'s recurrent state after rows [0, t) of input x [n, d], for t = every, 2·every, ...
    -> [len(x) // every, Hv, Dk, Dv] (float64)."""
    cfg, w = model.config, model.weights.layers[layer]
    parts = RecurrentCache(state_shapes(cfg.family_config), dtype=torch.float32).parts
    state = {name: torch.zeros((1, *shape), dtype=torch.float32, device=x.device) for name, shape in parts}
    out = []
    for start in range(0, len(x) - every + 1, every):
        rows = x[start : start + every]
        batch = AttentionBatch(
            query_starts=[0, every],
            context_lens=[start + every],
            write_slots=rows.new_empty(0),
            read_slots=[None],
            state_slots=[0],
            state_fresh=[start == 0],
        )
        gdn_mixer(
            zero_centred_rms_norm(rows, w.input_norm, cfg.rms_norm_eps),
            w.mixer,
            cfg.family_config,
            batch,
            state,
            cfg.rms_norm_eps,
        )
        out.append(state["ssm"][0].double().clone())
    return torch.stack(out)
