"""Group-wise integer weights: the one form every packable GGUF block type is re-expressed in.

    weight[n, k] = q[n, k] * scale[n, k // group] + (min[n, k // group] or 0)

loader/gguf_groups.py makes it from GGUF blocks without changing a value; ops/packed_linear.py
packs it into the kernel's panels. Here: the form, its pure-torch dequantization (the reference),
and the row operations that keep every value: `concat_rows` fuses projections (q/k/v, gate/up)
whose formats may differ by first widening each to a common format that holds it exactly;
`permute_rows` reorders rows (llama.cpp's rope rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GroupedInts:
    """weight[n, k] = q[n, k] * scale[n, k // group] + (min[n, k // group] or 0)."""

    q: torch.Tensor  # [N, K] int8. bits=4: values 0..15 ; bits=8: values -128..127
    scale: torch.Tensor  # [N, K // group] float32, or float16 where every value is exactly an fp16
    min: torch.Tensor | None  # [N, K // group], scale's dtype; None means 0
    bits: int  # 4 or 8
    group: int  # number of consecutive k sharing a scale: 32 or 16

    def __post_init__(self) -> None:
        # Shapes and dtypes only: checking q's range would read every weight.
        if self.q.dtype != torch.int8 or self.q.dim() != 2:
            raise ValueError(f"q must be a 2-D int8 tensor, got {self.q.dtype} {tuple(self.q.shape)}")
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        rows, cols = self.q.shape
        if self.group <= 0 or cols % self.group:
            raise ValueError(f"group {self.group} does not divide the row length {cols}")
        groups = (rows, cols // self.group)
        if self.scale.dtype not in (torch.float16, torch.float32) or tuple(self.scale.shape) != groups:
            raise ValueError(
                f"scale must be float16/float32 {groups}, got {self.scale.dtype} {tuple(self.scale.shape)}"
            )
        if self.min is not None and (self.min.dtype != self.scale.dtype or tuple(self.min.shape) != groups):
            raise ValueError(f"min must be {self.scale.dtype} {groups}, got {self.min.dtype} {tuple(self.min.shape)}")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)


def dequantize_groups(g: GroupedInts) -> torch.Tensor:
    """float32 [N, K] values of `g`: the pure-torch reference for the runtime's kernels."""
    rows, cols = g.q.shape
    values = g.q.reshape(rows, cols // g.group, g.group).float()  # [N, K / group, group]
    values = values * g.scale.float().unsqueeze(-1)  # [N, K / group, group]
    if g.min is not None:
        values = values + g.min.float().unsqueeze(-1)
    return values.reshape(rows, cols)  # [N, K]


def concat_rows(parts: list[GroupedInts]) -> GroupedInts:
    """`parts` stacked along N, widened first to one format that holds each of them exactly."""
    if not parts:
        raise ValueError("concat_rows needs at least one part")
    cols = {p.q.shape[1] for p in parts}
    if len(cols) != 1:
        raise ValueError(f"concat_rows needs equal row lengths, got {sorted(cols)}")
    bits = max(p.bits for p in parts)
    group = math.gcd(*(p.group for p in parts))
    with_min = any(p.min is not None for p in parts)
    dtype = torch.float32 if any(p.scale.dtype == torch.float32 for p in parts) else torch.float16
    wide = [_widen(p, group, with_min, dtype) for p in parts]
    return GroupedInts(
        q=torch.cat([p.q for p in wide]),  # [sum N, K]
        scale=torch.cat([p.scale for p in wide]),  # [sum N, K // group]
        min=torch.cat([p.min for p in wide]) if with_min else None,  # [sum N, K // group]
        bits=bits,
        group=group,
    )


def permute_rows(g: GroupedInts, index: torch.Tensor) -> GroupedInts:
    """Row i of the result is row index[i] of `g` (index: 1-D integer tensor)."""
    if index.dim() != 1 or index.dtype.is_floating_point or index.dtype == torch.bool:
        raise ValueError(f"permute_rows needs a 1-D integer index, got {index.dtype} {tuple(index.shape)}")
    index = index.to(device=g.q.device, dtype=torch.long)
    return GroupedInts(
        q=g.q.index_select(0, index),  # [len(index), K]
        scale=g.scale.index_select(0, index),  # [len(index), K // group]
        min=None if g.min is None else g.min.index_select(0, index),
        bits=g.bits,
        group=g.group,
    )


def _widen(g: GroupedInts, group: int, with_min: bool, dtype: torch.dtype) -> GroupedInts:
    """`g` with finer groups, a float32 scale or a min, all without changing a value.

    A missing min becomes -0.0, not 0.0: x + (-0.0) is x for every x, -0.0 included.
    """
    repeat = g.group // group
    scale = g.scale.to(dtype).repeat_interleave(repeat, dim=1)  # [N, K // group]
    if g.min is not None:
        minimum = g.min.to(dtype).repeat_interleave(repeat, dim=1)  # [N, K // group]
    elif with_min:
        minimum = torch.full_like(scale, -0.0)  # [N, K // group]
    else:
        minimum = None
    return GroupedInts(q=g.q, scale=scale, min=minimum, bits=g.bits, group=group)
