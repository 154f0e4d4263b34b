"""Each row's first maximum index over a large last dimension (greedy picks over the vocabulary).

torch's index-returning reductions (max(-1).indices, argmax) are not vectorized on the CPU: over a
[16, 262144] float32 block of logits (Gemma 3's vocabulary at batch 16) they take ~1.8 ms, while
amax, which returns only values, takes ~0.12 ms. row_argmax finds the maximum with amax over blocks
of `block` columns, the first block that holds it, and then the index inside that one block:
~0.2 ms for the same logits, and the same index torch gives (first maximum), also on ties.
A row with a NaN has no such first maximum under amax; those rows take torch's own answer.
"""

from __future__ import annotations

import torch

_BLOCK = 1024  # columns per block: [16, 262144] measured 0.20 / 0.21 / 0.25 ms at 512 / 1024 / 2048


def row_argmax_reference(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] -> [R] int64, the index of each row's first maximum (a NaN counts as the maximum)."""
    return x.max(-1).indices


def row_argmax(x: torch.Tensor, block: int = _BLOCK) -> torch.Tensor:
    """x [R, V] float -> [R] int64: row_argmax_reference's answer, by block maxima."""
    rows, cols = x.shape
    full = cols // block
    if full < 2 or x.stride(-1) != 1:  # one block: nothing to skip
        return row_argmax_reference(x)
    block_max = x[:, : full * block].view(rows, full, block).amax(-1)  # [R, full]
    if full * block < cols:  # the last, shorter block
        block_max = torch.cat([block_max, x[:, full * block :].amax(-1, keepdim=True)], 1)  # [R, full + 1]
    row_max = block_max.amax(-1, keepdim=True)  # [R, 1]
    if bool(row_max.isnan().any()):  # NaN == NaN is false: no block would match
        return row_argmax_reference(x)
    first = (block_max == row_max).to(torch.uint8).argmax(-1)  # [R] first block holding the maximum
    start = first * block  # [R]
    # the block's columns; a shorter last block repeats column V - 1, which comes after the real one
    cols_at = (start[:, None] + torch.arange(block, device=x.device)).clamp_max(cols - 1)  # [R, block]
    return start + x.gather(1, cols_at).max(-1).indices
