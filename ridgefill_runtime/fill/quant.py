"""Symmetric int8 with one bf16 scale per 128 weights of a row (the map file's weight format).

A row of d_in weights splits into ceil(d_in / 128) groups; the last may be shorter.
Round-trip bound per weight: |w - ŵ| <= s/2 + |q|·|s - s_bf16| where s = absmax/127 and
s_bf16 is s rounded to bf16 (relative error <= 2^-8), i.e. <= s/2 + 127·s·2^-8 ≈ 0.996·s.
"""

from __future__ import annotations

import torch

GROUP = 128


def num_groups(d_in: int, group: int = GROUP) -> int:
    return -(-d_in // group)


def quantize_int8_groupwise(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """w [d_out, d_in] float -> (qweight int8 [d_out, d_in], scales bf16 [d_out, ceil(d_in/group)])."""
    d_out, d_in = w.shape
    g = num_groups(d_in, group)
    padded = torch.zeros(d_out, g * group, dtype=torch.float64)
    padded[:, :d_in] = w.double()
    blocks = padded.view(d_out, g, group)  # [d_out, G, group]
    scales = (blocks.abs().amax(-1) / 127.0).to(torch.bfloat16)  # [d_out, G]
    # NOTE: quantize against the bf16-rounded scale the file stores, so dequantization
    # reproduces exactly what was chosen here; an all-zero group keeps scale 0 -> q 0.
    s = scales.double().clamp_min(torch.finfo(torch.float64).tiny)[..., None]
    q = torch.round(blocks / s).clamp_(-127, 127).to(torch.int8)
    return q.view(d_out, g * group)[:, :d_in].contiguous(), scales


def dequantize_int8_groupwise(
    q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32, group: int = GROUP
) -> torch.Tensor:
    """(qweight [d_out, d_in], scales [d_out, G]) -> weights [d_out, d_in] in `dtype`."""
    d_out, d_in = q.shape
    per_col = scales.float().repeat_interleave(group, dim=1)[:, :d_in]  # [d_out, d_in]
    return (q.float() * per_col).to(dtype)
