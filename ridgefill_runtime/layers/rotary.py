"""Rotary position embedding (rotate-half layout, as in Hugging Face Llama/Qwen3)."""

from __future__ import annotations

import math

import torch

from ..config import ModelConfig, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Per-pair rotation speeds [head_dim/2], float32, with llama3 scaling applied if given."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)  # [D/2]
    if scaling is None:
        return inv_freq
    return _llama3_scale(inv_freq, scaling)


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # NOTE: long wavelengths are slowed by `factor`, short ones kept, and the band between
    # the two cut-offs blends linearly in 1/wavelen (Llama 3.1's recipe).
    wavelen = 2 * math.pi / inv_freq
    long_cut = s.original_max_position_embeddings / s.low_freq_factor
    short_cut = s.original_max_position_embeddings / s.high_freq_factor
    slowed = inv_freq / s.factor
    blend = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    mid = (1 - blend) * slowed + blend * inv_freq
    out = torch.where(wavelen > long_cut, slowed, inv_freq)
    in_band = (wavelen >= short_cut) & (wavelen <= long_cut)
    return torch.where(in_band, mid, out)


class RotaryTable:
    """cos/sin rows per absolute position, grown on demand; indexed by a positions tensor."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu"):
        self.inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        self.device = torch.device(device)
        self.cos = torch.empty(0, config.head_dim, device=self.device)
        self.sin = torch.empty(0, config.head_dim, device=self.device)
        self._ensure(max(config.max_position_embeddings, 1))

    def _ensure(self, length: int) -> None:
        if length <= self.cos.shape[0]:
            return
        pos = torch.arange(length, dtype=torch.float32)
        angles = pos[:, None] * self.inv_freq[None, :]  # [P, D/2]
        emb = torch.cat([angles, angles], dim=-1)  # [P, D]
        self.cos = emb.cos().to(self.device)
        self.sin = emb.sin().to(self.device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, D] for positions [N]."""
        self._ensure(int(positions.max()) + 1 if positions.numel() else 0)
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] rotated by cos/sin [N, D] (rotate-half pairing: i with i + D/2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
