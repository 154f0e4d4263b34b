"""RidgeFill's two-sweep prefill on the Gated DeltaNet hybrids (seed 000 §2.3, §2.4 "Two sweeps").

One engine step of it, given the runner's FillStep:
  lower sweep  rows starting at layer 0 run the layers below the split exactly (their GDN states
               carried as usual); filled rows then write every late *attention* layer's K/V from
               x̂_l = predict(l, x_S). The late GDN layers wait.
  probe        the probe rows run the exact late layers over the filled attention cache, their
               GDN layers from a scratch state (the runner marks their first rows fresh; the late
               sweep starts afresh at position 0, so nothing of it survives).
  late sweep   every prefix row in position order, then the tail: each late GDN layer's state
               is carried over all of them, from x̂_l on filled rows and from the true input on
               exact rows. Filled rows compute only that state update (no output, no attention,
               no MLP); exact rows and the tail run everything, over the filled K/V.
"""

from __future__ import annotations

import torch

from ..cache.build import kv_pool_of
from ..fill.corrections import rescale_filled
from ..fill.late_part import late_part, mass_hook
from ..fill.step import FillStep
from ..fill.terminal_state import correct_state, filled_share
from ..layers.gated_deltanet import gdn_mixer
from ..layers.zero_centred_norm import zero_centred_rms_norm
from .forward import ForwardBatch, ForwardOutput


def two_sweep(model, batch: ForwardBatch) -> ForwardOutput:
    fill: FillStep = batch.fill
    kv = kv_pool_of(batch.caches)
    lower_mass, late_mass = [[] for _ in fill.lower_mass], [[] for _ in fill.late_mass]
    h = model.embed(batch.input_ids)  # [N, d]
    rope = model.rope(batch.positions)
    on_q = mass_hook(fill.lower_mass, kv, lower_mass, model.scale)
    for i in range(fill.split if batch.attention.num_seqs else 0):
        h = model.layer(i, h, rope, batch.attention, batch.caches, on_q=on_q)
    split_states = h[fill.exit_rows]  # [X, d]
    if fill.predict is not None and len(fill.fill_rows):
        _write_filled_kv(model, kv, h[fill.fill_rows], tuple(t[fill.fill_rows] for t in rope), fill)
    h_late, rope_late = late_part(h, rope, model.rope, fill)
    if h_late.shape[0]:
        on_q = mass_hook(fill.late_mass, kv, late_mass, model.scale)
        h_late = _late_layers(model, h_late, rope_late, fill, batch.caches, kv, on_q)
    top = h_late if batch.logit_rows is None else h_late[batch.logit_rows]
    return ForwardOutput(model.logits(top), split_states, tuple(map(tuple, lower_mass)), tuple(map(tuple, late_mass)))


def _write_filled_kv(model, kv, x_split: torch.Tensor, rope, fill: FillStep) -> None:
    """Filled rows [F, d] at the split -> their K/V in every late attention layer."""
    hybrid = model.config.family_config
    for layer in range(fill.split, model.config.num_layers):
        if not hybrid.is_linear(layer):
            k, v = model.kv_only(layer, fill.predict(layer, x_split), rope)
            kv.write(layer, fill.fill_slots, k, v)


def _late_layers(model, h: torch.Tensor, rope, fill: FillStep, caches, kv, on_q) -> torch.Tensor:
    """The late part [M, d] through layers split.. of the model. Filled rows keep their split
    state in h (each GDN layer reads x̂_l from it); the other rows carry their hidden state."""
    cfg = model.config
    filled, exact = fill.late_filled, fill.late_exact
    exact_batch = fill.late_exact_batch if filled is not None else fill.late_batch
    x_split = h[filled] if filled is not None else None  # [F, d]
    rescale_x = [h[r.rows] for r in fill.rescales]  # split states of the rows measuring a rescale
    rope_exact = rope if exact is None else tuple(t[exact] for t in rope)
    q_hook = on_q if on_q is None or exact is None else _scattered_hook(on_q, exact, h.shape[0])
    carried = _filled_or_none(fill, h)  # which rows' gates count as filled in ρ's sums
    for i in range(fill.split, cfg.num_layers):
        w = model.weights.layers[i]
        if cfg.family_config.is_linear(i):
            x_in = h
            if filled is not None:
                x_in = h.clone()
                x_in[filled] = fill.predict(i, x_split)  # x̂_l: filled rows only carry the state
            xn = _norm(x_in, w.input_norm, cfg)
            state = caches.states.state(i)
            history = caches.states.histories.get(i) if fill.late_batch.verifies is not None else None
            mixed = gdn_mixer(
                xn,
                w.mixer,
                cfg.family_config,
                fill.late_batch,
                state,
                cfg.rms_norm_eps,
                out_rows=exact,
                filled=carried,
                history=history,
            )
            _terminal_correction(i, fill, state)
            h_exact = (x_in if exact is None else x_in[exact]) + mixed
        elif exact is not None and exact.numel() == 0:
            continue  # every row of the step is filled: nothing attends, nothing runs its MLP
        else:
            _rescale(model, i, h, rope, fill, rescale_x, kv)
            h_exact = h if exact is None else h[exact]
            h_exact = h_exact + model.attention(
                i, _norm(h_exact, w.input_norm, cfg), rope_exact, exact_batch, kv, on_q=q_hook
            )
        if h_exact.shape[0]:
            h_exact = model.mlp(i, h_exact)
        if exact is None:
            h = h_exact
        else:
            h[exact] = h_exact
    return h


def _rescale(model, layer: int, h: torch.Tensor, rope, fill: FillStep, rescale_x, kv) -> None:
    """Value / key rescale (seed 000 §2.3) at an attention layer, before the rows reading the
    filled K/V attend: the measuring rows' K/V from their true input and from x̂ give the ratios."""
    for r, x in zip(fill.rescales, rescale_x):
        rope_r = tuple(t[r.rows] for t in rope)
        k, v = model.kv_only(layer, h[r.rows], rope_r)
        k_pred, v_pred = model.kv_only(layer, fill.predict(layer, x), rope_r)
        rescale_filled(kv, layer, r, k, v, k_pred, v_pred)


def _filled_or_none(fill: FillStep, h: torch.Tensor) -> torch.Tensor | None:
    """The filled-row mask, when the correction is on: every late step carries the sums ρ is read
    from (a step with no filled row: all zeros)."""
    if fill.terminal_shift is None:
        return None
    return fill.late_filled if fill.late_filled is not None else h.new_zeros(h.shape[0], dtype=torch.bool)


def _terminal_correction(layer: int, fill: FillStep, state) -> None:
    """At the prefix's end: S += ρ·ΔM (seed 000 §2.3), ρ from the sums the mixer just carried."""
    if fill.terminal_shift is None:
        return
    shift = fill.terminal_shift(layer)  # [Hv, Dk, Dv]
    for k in fill.prefix_ends:
        slot = fill.late_batch.state_slots[k]
        state["ssm"][slot] = correct_state(state["ssm"][slot], filled_share(state["share"][slot]), shift)


def _norm(x, weight_plus_one, cfg):
    return zero_centred_rms_norm(x, weight_plus_one, cfg.rms_norm_eps)


def _scattered_hook(on_q, exact: torch.Tensor, size: int):
    """The mass requests index the whole late part: hand them queries at those indices."""

    def hook(layer: int, q: torch.Tensor) -> None:
        full = q.new_zeros((size,) + tuple(q.shape[1:]))
        full[exact] = q
        on_q(layer, full)

    return hook
