"""The 8-bit K/V cache (cache.kv_dtype = "int8"): symmetric int8 with one float32 scale per
(slot, KV head), i.e. per block of head_dim values.

A written row x [D] is stored as round(x / s) with s = max|x| / 127, so each element comes back
within s / 2 of what was written (s = 0 for an all-zero row, which comes back as zeros). One
scale per head row, not per slab or per channel: a K/V row is written once, whole, and never
updated, so its scale is fixed when it is written and no later row can widen it.

Every reader dequantizes the same way, float(q) * s in float32 (KVPool.read, the pure-torch
attention reference and the CPU kernel), so the paths agree to summation order."""

from __future__ import annotations

import torch

QMAX = 127  # symmetric: -128 is never used, so negation stays exact


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, Hkv, D] float -> (int8 [N, Hkv, D], float32 scales [N, Hkv])."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / QMAX  # [N, Hkv]
    # NOTE: an all-zero row has scale 0; dividing by 1 there keeps its zeros instead of NaN
    q = torch.round(x / torch.where(scale > 0, scale, 1.0)[..., None]).clamp_(-QMAX, QMAX)  # [N, Hkv, D]
    return q.to(torch.int8), scale


def write(slab_k, slab_v, scale_k, scale_v, at: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Quantize k, v [N, Hkv, D] into the int8 slabs [S, Hkv, D] and their scales [S, Hkv] at slots at [N]:
    the compiled CPU op where it is built (one call instead of a dozen small torch ops per layer and step,
    the same bytes), else quantize() and index_copy_."""
    if _compiled_write() and slab_k.device.type == "cpu":
        torch.ops.ridgefill.int8_kv_write(slab_k, slab_v, scale_k, scale_v, at, k.float(), v.float())
        return
    for slab, scales, x in ((slab_k, scale_k, k), (slab_v, scale_v, v)):
        q, s = quantize(x)  # [N, Hkv, D] int8, [N, Hkv]
        slab.index_copy_(0, at, q)
        scales.index_copy_(0, at, s)


_WRITE_OP: bool | None = None  # csrc/cpu/int8_kv_cpu.cpp is loaded (looked up once, on the first write)


def _compiled_write() -> bool:
    global _WRITE_OP
    if _WRITE_OP is None:
        from ..ops.extension import op_available

        _WRITE_OP = op_available("int8_kv_write")
    return _WRITE_OP


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 [N, Hkv, D] and float32 scales [N, Hkv] -> [N, Hkv, D] in `dtype` (product in float32)."""
    return (q.float() * scale[..., None]).to(dtype)
