"""Value and key rescale (seed 000, §2.3 and §6.6): per KV head, the ratio of exact to
predicted norms on the first c tail rows multiplies the filled rows' values (or keys)."""

from __future__ import annotations

import torch

from .step import Rescale


def head_norm_ratio(exact: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """exact, predicted [c, Hkv, D] -> [Hkv]: mean over rows of ||exact|| / ||predicted||."""
    e = exact.float().norm(dim=-1)  # [c, Hkv]
    p = predicted.float().norm(dim=-1).clamp_min(1e-12)
    return (e / p).mean(0)


def rescale_filled(kv, layer: int, r: Rescale, k_exact, v_exact, k_pred, v_pred) -> None:
    """Multiply the filled slots' cached values / keys of `layer` by the measured ratios."""
    slots = kv.physical(layer, r.filled_slots)  # [P] the slab's own slots (kv_pool.py)
    if r.values:
        kv.scale_slots(layer, slots, head_norm_ratio(v_exact, v_pred), keys=False)
    if r.keys:
        # NOTE: RoPE is a rotation, so the ratio of key norms is the same before and after it.
        kv.scale_slots(layer, slots, head_norm_ratio(k_exact, k_pred), keys=True)
