"""Rotary position embedding (rotate-half layout, as in Hugging Face Llama/Qwen3)."""

from __future__ import annotations

import math

import torch

from ..config import ModelConfig, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Per-pair rotation speeds [head_dim/2], float32, with llama3 scaling applied if given."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [D/2]
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
    """cos/sin of each (position, pair) angle, grown on demand; indexed by a positions tensor.

    NOTE: rotate-half pairs dimension i with i + D/2 under one angle, so a half-width
    table is enough and halves the per-step gather.
    """

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu"):
        self.inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        self.device = torch.device(device)
        self.cos = torch.empty(0, config.head_dim // 2, device=self.device)
        self.sin = torch.empty(0, config.head_dim // 2, device=self.device)
        self._ensure(max(config.max_position_embeddings, 1))

    def _ensure(self, length: int) -> None:
        if length <= self.cos.shape[0]:
            return
        pos = torch.arange(length, dtype=torch.float32)
        angles = pos[:, None] * self.inv_freq[None, :]  # [P, D/2]
        self.cos = angles.cos().to(self.device)
        self.sin = angles.sin().to(self.device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, 1, D/2] for positions [N], ready to broadcast over heads."""
        # NOTE: not while a decode graph is captured (decode_graphs.py): reading the max would sync,
        # and the table already covers max_position_embeddings, past which no engine row goes
        if not (positions.is_cuda and torch.cuda.is_current_stream_capturing()):
            self._ensure(int(positions.max()) + 1 if positions.numel() else 0)
        return self.cos[positions, None].to(dtype), self.sin[positions, None].to(dtype)
