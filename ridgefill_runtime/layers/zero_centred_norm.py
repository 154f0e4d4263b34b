"""The hybrids' RMSNorm (Qwen3.5 / Qwen3-Next): weight stored as w, applied as (1 + w), in float32."""

from __future__ import annotations

import torch


def zero_centred_rms_norm(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n] normalised and scaled by (1 + w) [n] in float32, then cast back to x's dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight_plus_one).to(x.dtype)
