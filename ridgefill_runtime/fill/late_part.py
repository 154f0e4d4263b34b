"""The late part of a two-sweep step, assembled at the split: this step's stay rows (ordinary
sequences running every layer) and the stashed split states of probe / exact / tail rows
joining from earlier steps, each with its rotary angles; and the selectors' attention-mass hook.
Used by the two-sweep driver (two_sweep.py) for every family."""

from __future__ import annotations

import torch

from ..layers.attention import key_mass
from .step import FillStep, MassRequest


def late_part(h: torch.Tensor, rope: tuple[torch.Tensor, ...], rope_at, fill: FillStep):
    """h [N, d] at the split, rope: its rows' (cos, sin); rope_at(positions) -> (cos, sin) of
    other positions. Returns (h_late [M, d], rope_late)."""
    lower, late = fill.lower, fill.late
    h_late = h.new_empty(late.size, h.shape[1])  # [M, d]
    h_late[late.stay_to] = h[lower.stay_rows]
    h_late[late.to] = late.x
    joining = rope_at(late.pos)
    rope_late = []
    for t, tj in zip(rope, joining):
        part = t.new_empty((late.size,) + tuple(t.shape[1:]))
        part[late.stay_to] = t[lower.stay_rows]
        part[late.to] = tj
        rope_late.append(part)
    return h_late, tuple(rope_late)


def mass_hook(
    requests: tuple[MassRequest, ...], kv, found: list[list[torch.Tensor]], scale: float, window_of, sum_shards
):
    """An on_q(layer, q) hook appending, per request, the attention its keys receive at each of
    its layers ([K] float32) to found[request]; the runner adds them into its accumulators.
    window_of(layer): that layer's sliding window (0: none). sum_shards: the model's sum over
    tensor-parallel ranks (each holds some heads; every rank must pick the same exact rows).
    None when nothing is requested."""
    if not requests:
        return None

    def on_q(layer: int, q: torch.Tensor) -> None:
        for r, masses in zip(requests, found):
            if layer in r.layers:
                masses.append(sum_shards(_mass(kv, layer, q[r.rows], r, scale, window_of(layer))))  # [K]

    return on_q


def _mass(kv, layer: int, q: torch.Tensor, r: MassRequest, scale: float, window: int) -> torch.Tensor:
    """What each of r's keys [K] receives from rows q [R, H, D] at `layer`. NOTE: a windowed layer
    reads only keys some row can see: older ones may be unwritten (the fill writes what later
    rows reach) or their pages given back (cache/window_pages.py)."""
    if not window:
        k, _ = kv.read(layer, r.key_slots)  # [K, Hkv, D]
        return key_mass(q, r.q_pos, k, r.key_pos, scale)
    seen = r.key_pos >= int(r.q_pos.min()) - window + 1  # [K]
    k, _ = kv.read(layer, r.key_slots[seen])
    mass = torch.zeros(r.key_pos.shape[0], dtype=torch.float32, device=q.device)
    mass[seen] = key_mass(q, r.q_pos, k, r.key_pos[seen], scale, window=window)
    return mass
