"""int8_map_gemm: the RidgeFill map x̂ = A x_S + b with A stored as int8 (W8A16).

Format (the map files; seed 000 §4: "int8 with one scale per 128 weights of each row"):
  qweight  int8     [d_out, d_in]          round(w / scale), |q| <= 127
  scales   bfloat16 [d_out, d_in // 128]   one symmetric scale per 128 consecutive weights of a row
  bias     bfloat16 [d_out] or None
  y = x @ (qweight * scales).T + bias, in x's dtype, accumulated in fp32.

The CUDA kernel (csrc/int8_map_gemm.cu) fuses the dequantization into the GEMM: a GEMV-style path for
M <= 8 (decode/probe-sized batches; exact fp32 dequantization) and a tensor-core path for larger M in
bf16/fp16 (each weight tile is dequantized into x's dtype in shared memory, i.e. the rounding torch gets
from `x @ dequantize(...).to(x.dtype).T`).

Quantizer round trip. `quantize_int8_groupwise` stores ŝ = absmax/127 rounded *up* to bfloat16, so that
|w| / ŝ <= 127 and no weight is clamped. Then, with ŵ = q·ŝ (exact in fp32),
    |w − ŵ| <= ŝ/2 · (1 + 2^-16)          (the 2^-16 covers the fp32 division w/ŝ before rounding)
    ŝ <= (absmax/127) · (1 + 2^-7)       (the bf16 scale-rounding term: one bf16 ulp, relative 2^-7)
so |w − ŵ| <= (absmax/254) · (1 + 2^-7) · (1 + 2^-16) per group. tests/ops/test_int8_map_gemm.py checks
both inequalities.
"""

from __future__ import annotations


import torch

from .extension import op_available

_OP_NAME = "ridgefill::int8_map_gemm"
GROUP = 128  # format constant; the kernel is compiled for it
_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_args(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
    """The contract the CUDA kernel enforces, applied on every path alike."""
    if x.dtype not in _X_DTYPES:
        raise TypeError(f"int8_map_gemm: unsupported x dtype {x.dtype} (expected float32, bfloat16 or float16)")
    if qweight.dtype != torch.int8:
        raise TypeError(f"int8_map_gemm: qweight must be int8, got {qweight.dtype}")
    if scales.dtype != torch.bfloat16 or (bias is not None and bias.dtype != torch.bfloat16):
        raise TypeError("int8_map_gemm: scales and bias must be bfloat16")
    if x.dim() != 2 or qweight.dim() != 2 or qweight.shape[1] != x.shape[1]:
        raise ValueError(
            f"int8_map_gemm: need x [M, d_in] and qweight [d_out, d_in]; got {tuple(x.shape)}, {tuple(qweight.shape)}"
        )
    d_out, d_in = qweight.shape
    if d_in % GROUP:
        raise ValueError(f"int8_map_gemm: d_in must be a multiple of {GROUP}, got {d_in}")
    if tuple(scales.shape) != (d_out, d_in // GROUP):
        raise ValueError(f"int8_map_gemm: scales must be [{d_out}, {d_in // GROUP}], got {tuple(scales.shape)}")
    if bias is not None and tuple(bias.shape) != (d_out,):
        raise ValueError(f"int8_map_gemm: bias must be [{d_out}], got {tuple(bias.shape)}")


def dequantize_int8_groupwise(qweight: torch.Tensor, scales: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """ŵ = q · ŝ in float32 [d_out, d_in]; exact (|q| <= 127 has 7 bits, ŝ 8: the product fits fp32)."""
    d_out, d_in = qweight.shape
    w = qweight.to(torch.float32).view(d_out, d_in // group, group) * scales.to(torch.float32)[..., None]
    return w.view(d_out, d_in)


def quantize_int8_groupwise(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-group int8: w [d_out, d_in] float -> (qweight int8 [d_out, d_in], scales bf16 [d_out, d_in/group]).

    The scale is absmax/127 rounded up to the next bfloat16 (see the module docstring for the bound);
    all-zero groups get scale 0 and q = 0.
    """
    if w.dim() != 2 or w.shape[1] % group:
        raise ValueError(f"quantize_int8_groupwise: need [d_out, d_in] with d_in % {group} == 0, got {tuple(w.shape)}")
    w32 = w.to(torch.float32)
    if not torch.isfinite(w32).all():
        raise ValueError("quantize_int8_groupwise: weights must be finite")
    d_out, d_in = w32.shape
    groups = w32.view(d_out, d_in // group, group)  # [d_out, G, group]
    exact_scale = groups.abs().amax(dim=-1) / 127.0  # [d_out, G]
    scale = exact_scale.to(torch.bfloat16)
    # Round up: bump by one ulp where round-to-nearest went down. bf16 bits of a
    # non-negative finite value are ordered like the value, so +1 is the next one up.
    low = scale.to(torch.float32) < exact_scale
    scale = torch.where(low, (scale.view(torch.int16) + 1).view(torch.bfloat16), scale)
    s32 = scale.to(torch.float32)[..., None]  # [d_out, G, 1]
    q = torch.where(s32 > 0, torch.round(groups / torch.where(s32 > 0, s32, 1.0)), 0.0)
    # |w|/ŝ <= 127 by construction; the clamp only guards the fp32 division's last ulp.
    q = q.clamp_(-127, 127).to(torch.int8).view(d_out, d_in)
    return q, scale


def int8_map_gemm_reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """y = (x @ dequantize(qweight, scales).T + bias) in fp32, rounded once to x's dtype. x [M, d_in] -> [M, d_out]."""
    _check_args(x, qweight, scales, bias)
    y = x.to(torch.float32) @ dequantize_int8_groupwise(qweight, scales).T  # [M, d_out]
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


if op_available("int8_map_gemm"):

    @torch.library.register_fake(_OP_NAME)
    def _int8_map_gemm_fake(x, qweight, scales, bias):
        _check_args(x, qweight, scales, bias)
        return x.new_empty((x.shape[0], qweight.shape[0]))

    @torch.library.register_kernel(_OP_NAME, "cpu")
    def _int8_map_gemm_cpu(x, qweight, scales, bias):
        return int8_map_gemm_reference(x, qweight, scales, bias)

    _cuda_impl = torch.ops.ridgefill.int8_map_gemm.default
else:
    _cuda_impl = int8_map_gemm_reference


def int8_map_gemm(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Apply an int8 map to x [..., d_in] -> [..., d_out] (leading dims are flattened for the kernel)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [M, d_in]
    y = _cuda_impl(x2, qweight, scales, bias) if x.is_cuda else int8_map_gemm_reference(x2, qweight, scales, bias)
    return y.view(*lead, qweight.shape[0])
