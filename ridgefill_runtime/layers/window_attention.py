"""Sliding-window attention (and a global layer's scattered rows) in bands of query rows.

A windowed layer's row at position p reads only keys in (p - window, p]. Handing SDPA one
[R, Lk] mask makes it score every pair and mask most away: at 8K rows and a 512 window that
is 16x the work (one Gemma 3 270M layer, 2 threads: 1.18 s vs 0.12 s; a filled prefill's
1,845 scattered exact rows over 32K keys: 1.18 s vs 0.18 s; benchmarks/prefill_attention.md).
Here the rows, sorted by position, go in bands; a band scores only the keys from its first
row's window start to its last row, a contiguous slice of the sorted keys.

On a windowed layer a band is the rows inside one run of `block` positions, not `block` rows:
the fill's scattered exact rows lie ~10 positions apart, so 256 of them spanned ~2,500
positions and each row scored ~3,000 keys to use 512 (Gemma 3 270M at 16K: 7 late window
layers, ~0.7 s of a 24 s fill). Cut by position, a band scores at most block + window - 1 keys
a row, as a contiguous prefill's band does. A global layer's row reads every earlier key, so
there a band stays `block` rows: a wide span adds few keys to the many each row needs anyway.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BAND_BLOCK = 256  # query rows a band holds (128-512 measured within 10% at 4K-16K)


def worth_banding(q_len: int, k_len: int, window: int) -> bool:
    """On a windowed layer bands pay as soon as some key falls out of a row's window: one
    Gemma 3 270M layer (4 heads, window 512, 2 threads) at 600 / 1K / 1.5K rows took 7.1 / 15.7 /
    26.7 ms in bands against 8.8 / 24.0 / 53.8 ms under one mask. A global layer (window 0)
    bands only scattered rows once the keys reach well past one band: a band stops at its last
    row's keys."""
    return q_len > 1 and (k_len > window if window else k_len > 2 * BAND_BLOCK)


def banded_window_attention(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    window: int,
    block: int = BAND_BLOCK,
) -> torch.Tensor:
    """Rows q [R, H, D] at ascending positions q_pos [R] over keys k/v [Lk, Hkv, D] at ascending
    positions k_pos [Lk]; a row sees the keys at most window - 1 positions behind it (window 0:
    every earlier key), itself included -> [R, H*D]."""
    rows, heads, dim = q.shape
    out = q.new_empty(rows, heads * dim)
    starts = band_starts(q_pos, block, window)  # [bands + 1] row boundaries
    firsts, lasts = q_pos[starts[:-1]], q_pos[starts[1:] - 1]  # [bands] each band's first and last position
    lo = torch.searchsorted(k_pos, (firsts - window + 1).contiguous()).tolist() if window else [0] * len(firsts)
    hi = torch.searchsorted(k_pos, lasts.contiguous(), right=True).tolist()
    for b, (r0, r1) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist())):
        qp, kp = q_pos[r0:r1], k_pos[lo[b] : hi[b]]  # [r], [n]
        gap = qp[:, None] - kp[None, :]  # [r, n] how far behind each row a key is
        mask = (gap >= 0) & (gap < window) if window else gap >= 0
        qh = q[r0:r1].transpose(0, 1).unsqueeze(0)  # [1, H, r, D]
        kh = k[lo[b] : hi[b]].transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, D]
        vh = v[lo[b] : hi[b]].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
        out[r0:r1] = o[0].transpose(0, 1).reshape(-1, heads * dim)
    return out


def band_starts(q_pos: torch.Tensor, block: int, window: int) -> torch.Tensor:
    """Row boundaries [bands + 1] of the bands over rows at ascending positions q_pos [R]: with a
    window, the rows inside each run of `block` positions (p // block); without, `block` rows."""
    rows, device = q_pos.shape[0], q_pos.device
    if not window:
        return torch.cat([torch.arange(0, rows, block, device=device), torch.tensor([rows], device=device)])
    _, counts = torch.unique_consecutive(torch.div(q_pos, block, rounding_mode="floor"), return_counts=True)
    return torch.cat([torch.zeros(1, dtype=counts.dtype, device=device), counts.cumsum(0)])
