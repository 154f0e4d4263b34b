"""RidgeFill's two-sweep prefill (seed 000 §2, §2.4 "Two sweeps"): one engine step of it, given the
runner's FillStep, on any family that implements models/fill_hooks.py.

  lower sweep  rows starting at layer 0 run the layers below the split exactly; there the exit
               rows stop (their split states come back) and filled rows write every late attention
               layer's K/V from x̂_l = predict(l, x_S) (at sliding-window layers only once a later
               row reaches them, when the step defers those writes).
  late part    stay rows and stashed split states of probe / exact / tail rows run every later
               layer over the filled cache. On a hybrid it also holds filled prefix rows, in
               position order with the rest: they only carry the late recurrent states from x̂_l
               (FillHooks.late_layer), and at the prefix's end the terminal correction is added.
  corrections  the value / key rescale at each late attention layer before anything attends, and
               the selectors' attention mass at the layers they ask for.
"""

from __future__ import annotations

import torch

from ..cache.build import kv_pool_of
from ..models.fill_hooks import FillHooks, LateRows
from ..models.forward import ForwardBatch, ForwardOutput
from .corrections import rescale_filled
from .late_part import late_part, mass_hook
from .step import FillStep
from .terminal_state import correct_terminal_states


@torch.inference_mode()
def two_sweep(model, batch: ForwardBatch) -> ForwardOutput:
    """The runner's entry for a step with a fill plan (batch.fill). Writes K/V and recurrent states
    into the given caches; returns the logits of batch.logit_rows (indices into the late part),
    the exit rows' split states and the requested attention masses."""
    if not isinstance(model, FillHooks):
        raise ValueError(f"{type(model).__name__} has no two-sweep prefill")
    fill: FillStep = batch.fill
    kv = kv_pool_of(batch.caches)
    lower_mass: list[list[torch.Tensor]] = [[] for _ in fill.lower.mass]
    late_mass: list[list[torch.Tensor]] = [[] for _ in fill.late.mass]
    h = model.embed(batch.input_ids)  # [N, d]
    rope = model.rope(batch.positions)
    on_q = mass_hook(fill.lower.mass, kv, lower_mass, model.scale, model.window, model.sum_shards)
    for i in range(fill.split if batch.attention.num_seqs else 0):
        h = model.layer(i, h, rope, batch.attention, batch.caches, on_q=on_q)
    split_states = h[fill.lower.exit_rows]  # [X, d]
    writes = _FilledWrites(model, kv, fill, h, rope)
    h, rope = late_part(h, rope, model.rope, fill)  # [M, d]
    rescales = _Rescales(model, kv, fill, h, rope)
    late = _late_rows(model, batch, fill, h, rope, kv, late_mass, rescales)
    last = model.config.num_layers - 1
    for i in range(fill.split, last + 1):
        if model.keeps_kv(i):
            writes.write(i)
            if not model.rescale_from_layer_kv:
                rescales.from_inputs(i, h)
        if not h.shape[0]:
            continue  # NOTE: only lower rows ran this step: their late K/V are all it writes
        h = model.late_layer(i, h, late, rows=batch.logit_rows if i == last else None)
        if fill.terminal is not None and not model.keeps_kv(i):
            correct_terminal_states(fill.terminal, i, batch.caches.states.state(i), fill.late.batch.state_slots)
    return ForwardOutput(model.logits(h), split_states, tuple(map(tuple, lower_mass)), tuple(map(tuple, late_mass)))


class _FilledWrites:
    """The K/V filled rows write at each late attention layer, from x̂ = predict(layer, x_S): the
    lower part's fill rows (but at sliding-window layers when the step defers those) and the
    deferred rows a late row reaches first this step (from the stash)."""

    def __init__(self, model: FillHooks, kv, fill: FillStep, h: torch.Tensor, rope):
        self.model, self.kv, self.fill = model, kv, fill
        self.x = h[fill.lower.fill_rows]  # [F, d]
        self.rope = tuple(t[fill.lower.fill_rows] for t in rope)
        windows = fill.windows
        self.reached = windows is not None and len(windows.pos) > 0
        self.rope_reached = model.rope(windows.pos) if self.reached else None

    def write(self, layer: int) -> None:
        model, fill = self.model, self.fill
        windowed = model.window(layer) > 0
        if fill.predict is not None and len(fill.lower.fill_rows) and not (fill.windows is not None and windowed):
            k_hat, v_hat = model.kv_only(layer, fill.predict(layer, self.x), self.rope)
            self.kv.write(layer, fill.lower.fill_slots, k_hat, v_hat)
        if self.reached and windowed:
            k_hat, v_hat = model.kv_only(layer, fill.predict(layer, fill.windows.x), self.rope_reached)
            self.kv.write(layer, fill.windows.slots, k_hat, v_hat)


class _Rescales:
    """Value / key rescale (seed 000 §2.3) at each late attention layer, before the rows reading
    the filled K/V attend: the measuring rows' K/V from their true input and from x̂ give the ratios.
    The true K/V are the layer's own (from_layer_kv, the model's on_kv hook) or, on a family whose
    layer cannot hand them out, its K/V projections of the rows' input (from_inputs)."""

    def __init__(self, model: FillHooks, kv, fill: FillStep, h: torch.Tensor, rope):
        """h [M, d], rope: the late part at the split."""
        self.model, self.kv, self.predict = model, kv, fill.predict
        # per rescale: the measuring rows' split states [c, d] and their rotary angles
        self.measured = [(r, h[r.rows], tuple(t[r.rows] for t in rope)) for r in fill.late.rescales]

    def from_layer_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [M, Hkv, D]: the layer's fresh K/V of the late part."""
        for r, x, rope in self.measured:
            k_pred, v_pred = self.model.kv_only(layer, self.predict(layer, x), rope)
            rescale_filled(self.kv, layer, r, k[r.rows], v[r.rows], k_pred, v_pred)

    def from_inputs(self, layer: int, h: torch.Tensor) -> None:
        """h [M, d]: the late part's input to `layer`."""
        for r, x, rope in self.measured:
            k, v = self.model.kv_only(layer, h[r.rows], rope)
            k_pred, v_pred = self.model.kv_only(layer, self.predict(layer, x), rope)
            rescale_filled(self.kv, layer, r, k, v, k_pred, v_pred)


def _late_rows(model: FillHooks, batch: ForwardBatch, fill: FillStep, h, rope, kv, found, rescales) -> LateRows:
    """What the late layers read. h [M, d], rope: the late part at the split; found: the late
    mass requests' lists the attention hook appends to."""
    on_q = mass_hook(fill.late.mass, kv, found, model.scale, model.window, model.sum_shards)
    on_kv = rescales.from_layer_kv if model.rescale_from_layer_kv and fill.late.rescales else None
    part = fill.filled_late
    share = None
    if fill.terminal is not None:  # every late step carries the sums ρ is read from
        share = part.filled if part is not None else h.new_zeros(h.shape[0], dtype=torch.bool)  # [M]
    if part is None:
        return LateRows(
            fill.late.batch, batch.caches, rope, fill.late.batch, share_filled=share, on_kv=on_kv, on_q=on_q
        )
    x_filled = h[part.filled]  # [F, d] the filled rows' split states: each recurrent layer reads x̂_l of them
    return LateRows(
        fill.late.batch,
        batch.caches,
        tuple(t[part.exact] for t in rope),
        part.exact_batch,
        exact=part.exact,
        filled=part.filled,
        predicted=lambda layer: fill.predict(layer, x_filled),
        share_filled=share,
        on_kv=on_kv,
        on_q=None if on_q is None else _scattered(on_q, part.exact, h.shape[0]),
    )


def _scattered(on_q, exact: torch.Tensor, size: int):
    """The mass requests index the whole late part: hand them the exact rows' queries there."""

    def hook(layer: int, q: torch.Tensor) -> None:
        full = q.new_zeros((size,) + tuple(q.shape[1:]))  # [M, H, D]
        full[exact] = q
        on_q(layer, full)

    return hook
