"""A head's RMSNorm and rotate-half RoPE: the torch reference, and one compiled CPU call for both.

Decode's query and key heads each take a norm (qk_norm families: Gemma 3, Qwen3) and a rotation. As
tensor ops that is ~11 small calls a layer (the norm, then an empty, four slices, two mul and two
addcmul), each costing more than its arithmetic at batch 1: ~25 us of a Gemma 3 layer, 0.45 ms of its
18-layer step. `ridgefill::rms_norm_rope` (csrc/cpu/rms_norm_cpu.cpp) does it in one pass in float32:
the norm is rms_norm's kernel, and the rotation rounds as torch's mul then addcmul do on x86 (ATen's
AVX2 / AVX-512 addcmul is one FMA), so there it gives the reference's bits (tests/ops/test_norm_rope.py
checks the kernel against that rounding emulated in float64). Other dtypes and devices take the reference.
"""

from __future__ import annotations

import torch

from .extension import op_available
from .rms_norm import rms_norm

_OP_NAME = "ridgefill::rms_norm_rope"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] rotated by cos/sin [N, 1, D/2]: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    lo, hi = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=lo)
    lo.addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=hi)
    hi.addcmul_(x1, sin)
    return out


def norm_rope_reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 0.0
) -> torch.Tensor:
    """x [N, H, D] -> rms_norm over D by `weight` [D] (none when None), then rotated by cos/sin [N, 1, D/2]."""
    return apply_rotary(x if weight is None else rms_norm(x, weight, eps), cos, sin)


if op_available("rms_norm_rope"):

    @torch.library.register_fake(_OP_NAME)
    def _rms_norm_rope_fake(x, weight, cos, sin, eps):
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    # NOTE: a _C built before the op existed has no CPU kernel for it: the reference serves then
    _CPU_KERNEL = torch._C._dispatch_has_kernel_for_dispatch_key(_OP_NAME, "CPU")
else:
    _CPU_KERNEL = False


def norm_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 0.0
) -> torch.Tensor:
    """norm_rope_reference's result; float32 CPU tensors whose heads are contiguous take the one-pass kernel."""
    fused = (
        _CPU_KERNEL
        and x.device.type == "cpu"
        and x.dtype == cos.dtype == sin.dtype == torch.float32
        and x.dim() == 3
        and x.stride(-1) == 1
        and (weight is None or weight.dtype == torch.float32)
    )
    if fused:
        return torch.ops.ridgefill.rms_norm_rope(x, weight, cos, sin, eps)
    return norm_rope_reference(x, cos, sin, weight, eps)
