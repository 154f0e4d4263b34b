"""The 8-bit K/V cache (cache.kv_dtype = "int8"): symmetric int8 with one float32 scale per GROUP = 32
consecutive values of a (slot, KV head) row, as llama.cpp's q8_0 K/V cache blocks them.

Group g of a written row x [D] (values 32g .. min(32g + 32, D)) is stored as round(x / s) with
s = max|x_g| / 127, so each element comes back within s / 2 of what was written (s = 0 for an
all-zero group, which comes back as zeros). A K/V row is written once, whole, and never updated,
so its scales are fixed when it is written. Why groups, not one scale per row: on Gemma 3 270M,
whose RMS-normed keys carry a few channels ~6x their row's RMS, one scale per row gave 1.2-1.9 %
relative error on K and V and changed the greedy answer from the first token on; groups of 32
halve the error (benchmarks/long_prompts/gemma3-270m-kv_dtype_agreement.txt).

Every reader dequantizes the same way, float(q) * s in float32 (KVPool.read, the pure-torch
attention reference and the CPU kernel), so the paths agree to summation order."""

from __future__ import annotations

import torch

QMAX = 127  # symmetric: -128 is never used, so negation stays exact
GROUP = 32  # values per scale


def groups(head_dim: int) -> int:
    """Scales per row: the last group holds the remainder of a head dim that is not a multiple of GROUP."""
    return -(-head_dim // GROUP)


def _grouped(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., G, GROUP], zero-padded at the end (a zero changes no group's max)."""
    d = x.shape[-1]
    pad = groups(d) * GROUP - d
    return torch.nn.functional.pad(x, (0, pad)).unflatten(-1, (groups(d), GROUP))


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, Hkv, D] float -> (int8 [N, Hkv, D], float32 scales [N, Hkv, G])."""
    d = x.shape[-1]
    xg = _grouped(x.float())  # [N, Hkv, G, 32]
    scale = xg.abs().amax(dim=-1) / QMAX  # [N, Hkv, G]
    # NOTE: an all-zero group has scale 0; dividing by 1 there keeps its zeros instead of NaN
    q = torch.round(xg / torch.where(scale > 0, scale, 1.0)[..., None]).clamp_(-QMAX, QMAX)  # [N, Hkv, G, 32]
    return q.flatten(-2)[..., :d].to(torch.int8), scale


def write(slab_k, slab_v, scale_k, scale_v, at: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Quantize k, v [N, Hkv, D] into the int8 slabs [S, Hkv, D] and their scales [S, Hkv, G] at slots at [N]:
    the compiled CPU op where it is built (one call instead of a dozen small torch ops per layer and step,
    the same bytes), else quantize() and index_copy_."""
    if _compiled_write() and slab_k.device.type == "cpu":
        torch.ops.ridgefill.int8_kv_write(slab_k, slab_v, scale_k, scale_v, at, k.float(), v.float())
        return
    for slab, scales, x in ((slab_k, scale_k, k), (slab_v, scale_v, v)):
        q, s = quantize(x)  # [N, Hkv, D] int8, [N, Hkv, G]
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
    """int8 [N, Hkv, D] and float32 scales [N, Hkv, G] -> [N, Hkv, D] in `dtype` (product in float32)."""
    per_value = scale.repeat_interleave(GROUP, dim=-1)[..., : q.shape[-1]]  # [N, Hkv, D]
    return (q.float() * per_value).to(dtype)
