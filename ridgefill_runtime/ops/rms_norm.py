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
