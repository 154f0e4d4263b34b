"""RMSNorm: torch reference, op registrations and the dispatching wrapper.

Convention (Hugging Face Llama/Qwen3 RMSNorm): normalise in float32, cast back
to the input dtype, then multiply by the weight in that dtype. The order
matters in bf16/fp16: multiplying before the cast rounds differently.
"""

from __future__ import annotations

import torch

from .extension import extension_loaded

_OP_NAME = "ridgefill::rms_norm"
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    """The contract the CUDA kernel enforces, applied on every path alike so
    that code which works on CPU does not start failing on GPU."""
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"rms_norm: unsupported dtype {x.dtype} (expected float32, bfloat16 or float16)")
    if weight.dtype != x.dtype:
        raise TypeError(f"rms_norm: weight dtype {weight.dtype} must match x dtype {x.dtype}")
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"rms_norm: weight must be 1-D of size x.shape[-1]; got x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`(x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype) * weight`, in plain torch."""
    _check_args(x, weight)
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight


if extension_loaded():

    @torch.library.register_fake(_OP_NAME)
    def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Shape/dtype propagation for torch.compile and meta tensors; the CUDA
        # kernel returns a fresh contiguous tensor shaped like x.
        _check_args(x, weight)
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    _compiled = torch.ops.ridgefill.rms_norm.default
    # csrc/cpu/rms_norm_cpu.cpp; a _C built before it existed has only the CUDA kernel
    _CPU_KERNEL = torch._C._dispatch_has_kernel_for_dispatch_key(_OP_NAME, "CPU")
else:
    _compiled = rms_norm_reference
    _CPU_KERNEL = False


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x; weight has shape (x.shape[-1],).

    Called once or twice per layer, so the only cost added here is one branch:
    CUDA and CPU tensors go to the compiled kernels when the extension is loaded
    (chosen once, at import), everything else (float64 included) to the torch reference.
    """
    if x.is_cuda or (_CPU_KERNEL and x.device.type == "cpu" and x.dtype in _SUPPORTED_DTYPES):
        _check_args(x, weight)
        return _compiled(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


# -- a residual add around RMSNorm ------------------------------------------------------------------
# Where a layer adds a block's output to the residual stream, it norms the sum next (and Gemma 3
# norms the block's output first): three tensor ops, ~4 us each at decode, 0.2 ms of an 18-layer
# Gemma 3 step. ridgefill::rms_norm_add (csrc/cpu/rms_norm_cpu.cpp) is one, bit for bit.

_ADD_KERNEL = extension_loaded() and torch._C._dispatch_has_kernel_for_dispatch_key("ridgefill::rms_norm_add", "CPU")
if _ADD_KERNEL:

    @torch.library.register_fake("ridgefill::rms_norm_add")
    def _rms_norm_add_fake(y, weight, residual, next_weight, eps):
        return torch.empty_like(y), torch.empty_like(y) if next_weight is not None else y.new_empty(0)


def rms_norm_add_reference(
    y: torch.Tensor,
    residual: torch.Tensor,
    eps: float,
    weight: torch.Tensor | None = None,
    next_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + (y normed by `weight`, or y itself when None), that sum normed by `next_weight`; an
    empty [0] tensor instead when next_weight is None)."""
    total = residual + (y if weight is None else rms_norm(y, weight, eps))
    return total, y.new_empty(0) if next_weight is None else rms_norm(total, next_weight, eps)


def rms_norm_add(
    y: torch.Tensor,
    residual: torch.Tensor,
    eps: float,
    weight: torch.Tensor | None = None,
    next_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm_add_reference's values; 2-D float32 CPU rows take the one-pass kernel."""
    fused = (
        _ADD_KERNEL
        and y.is_cpu
        and y.dtype == residual.dtype == torch.float32
        and y.dim() == 2
        and y.shape == residual.shape
        and all(w is None or w.dtype == torch.float32 for w in (weight, next_weight))
    )
    if not fused:
        return rms_norm_add_reference(y, residual, eps, weight, next_weight)
    return torch.ops.ridgefill.rms_norm_add(y, weight, residual, next_weight, eps)
