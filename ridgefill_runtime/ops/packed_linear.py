"""packed_linear: a linear layer whose weights stay group-quantized (GGUF's blocks, repacked).

A weight W [n, K] is held as integers q with one scale (and optionally one min) per `group`
consecutive k of a row: W[r, k] = q[r, k] * scale[r, k // group] + min[r, k // group]. GGUF's
Q8_0, Q4_0, Q4_1, Q4_K and Q6_K all say exactly this (loader/gguf_groups.py re-expresses them
without changing a value), so keeping the integers costs ~4.5-8.5 bits a weight instead of 32,
and decode, which reads every weight once per step, reads 4-7x fewer bytes.

Storage (what csrc/cpu/packed_linear.cpp reads): rows in panels of 16, k-major inside a panel,
so one 16-byte load gives 16 rows' weights at two k (4 bits) or one k (8 bits):
  data   bits 4: uint8 [P, K / 2, 16]  byte j of pair t: row 16p + j at k = 2t (low nibble), 2t + 1 (high)
         bits 8: int8  [P, K, 16]
  scale  float16 (where every scale is an exact fp16) or float32 [P, K / group, 16]
  min    like scale, or empty: no offset
Rows past n in the last panel are zero.

Kernels: csrc/cpu/packed_linear.cpp (CPU) and csrc/packed_linear.cu (CUDA); `compiled_for` says
whether one serves a device.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass, replace

import torch
import torch.nn.functional as F

from .extension import op_available

PANEL = 16
GEMM_DTYPES = (torch.float32, torch.bfloat16)
_KERNEL = torch.ops.ridgefill.packed_linear.default if op_available("packed_linear") else None
# NOTE: CPU only: x's whole 16-row blocks multiplied in bfloat16 (AVX512-BF16), for gemm_dtype =
# bfloat16 calls below BLAS_MIN_ROWS (decode batches of 16 and more); other rows as _KERNEL.
_KERNEL_BF16 = torch.ops.ridgefill.packed_linear_bf16.default if op_available("packed_linear_bf16") else None
_DEQUANTIZE_T = torch.ops.ridgefill.packed_dequantize_t.default if op_available("packed_dequantize_t") else None
# NOTE: CPU only: W.T written as bfloat16 for gemm_dtype = bfloat16 (no float32 copy to convert).
_DEQUANTIZE_T_BF16 = (
    torch.ops.ridgefill.packed_dequantize_t_bf16.default if op_available("packed_dequantize_t_bf16") else None
)
# NOTE: from this many rows (prefill chunks) a float32 BLAS GEMM on the weight dequantized for the
# call beats dequantizing in registers: on an AMX/AVX-512 Xeon, 512 rows ran 1.5-1.7x faster, and
# the same values go in (benchmarks/decode.md). Decode batches stay on the kernel, which reads 4-8x
# fewer bytes.
BLAS_MIN_ROWS = 128
# csrc/packed_linear.cu; a _C built without CUDA (or before that file existed) has only the CPU kernel.
_CUDA_KERNEL = (
    _KERNEL is not None
    and _DEQUANTIZE_T is not None
    and torch._C._dispatch_has_kernel_for_dispatch_key("ridgefill::packed_linear", "CUDA")
    and torch._C._dispatch_has_kernel_for_dispatch_key("ridgefill::packed_dequantize_t", "CUDA")
)
# NOTE: unmeasured until a GPU is lent. From this many rows on CUDA, packed_dequantize_t and a cuBLAS
# float32 GEMM instead of the in-register kernel, which runs its float32 FMAs on CUDA cores in tiles
# of 4 rows and so stops being memory bound after a few rows, while the GEMM pays one float32 write
# and read of W.T. Estimated from H200 peak rates, to be replaced by a measured crossover
# (benchmarks/packed_sweep.py --device cuda --rows ...).
CUDA_BLAS_MIN_ROWS = 32


def compiled_for(device: torch.device) -> bool:
    """A compiled packed kernel serves this device (else packed_linear dequantizes the weight per call)."""
    if device.type == "cuda":
        return _CUDA_KERNEL
    return device.type == "cpu" and _KERNEL is not None


@dataclass(frozen=True)
class PackedWeight:
    data: torch.Tensor  # uint8 [P, K / 2, 16] or int8 [P, K, 16]
    scale: torch.Tensor  # [P, K // group, 16]
    min: torch.Tensor  # like scale, or empty
    bits: int
    group: int
    n: int  # output rows
    # What a GEMM call (BLAS_MIN_ROWS rows and up: prefill chunks) multiplies in: float32 is
    # exact; bfloat16 rounds x, the weight and the output to bfloat16 and runs ~2.3x faster on a
    # CPU with AVX512-BF16 (benchmarks/long_prompts/*gemm_dtype_agreement.txt: what it costs).
    gemm_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.gemm_dtype not in GEMM_DTYPES:
            raise ValueError(f"a packed weight's gemm_dtype is float32 or bfloat16, got {self.gemm_dtype}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.data.shape[1] * (2 if self.bits == 4 else 1)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.min))

    def to(self, device) -> PackedWeight:
        return replace(self, data=self.data.to(device), scale=self.scale.to(device), min=self.min.to(device))

    def rows(self, lo: int, hi: int) -> PackedWeight:
        """Output rows lo..hi-1 (a fused projection's part); lo must start a panel."""
        if lo % PANEL:
            raise ValueError(f"packed rows must start at a multiple of {PANEL}, got {lo}")
        p0, p1 = lo // PANEL, -(-hi // PANEL)
        return replace(
            self,
            data=self.data[p0:p1],
            scale=self.scale[p0:p1],
            min=self.min[p0:p1] if self.min.numel() else self.min,
            n=hi - lo,
        )


def pack(q: torch.Tensor, scale: torch.Tensor, min: torch.Tensor | None, bits: int, group: int) -> PackedWeight:
    """q [n, K] int (bits 4: 0..15, bits 8: -128..127), scale/min [n, K // group] -> panels."""
    n, k = q.shape
    if bits not in (4, 8):
        raise ValueError(f"packed weights hold 4 or 8 bits, got {bits}")
    if k % group or tuple(scale.shape) != (n, k // group):
        raise ValueError(f"scale must be [{n}, {k} // {group}], got {tuple(scale.shape)}")
    lo, hi = (0, 15) if bits == 4 else (-128, 127)
    if q.numel() and (int(q.min()) < lo or int(q.max()) > hi):
        raise ValueError(f"{bits}-bit values must lie in [{lo}, {hi}]")
    pad = -n % PANEL
    # [n, c] -> [P, 16, c] (rows of a panel), padded with zero rows
    panel_rows = lambda t: F.pad(t, (0, 0, 0, pad)).view(-1, PANEL, t.shape[1])  # noqa: E731
    if bits == 4:
        if group % 2:
            raise ValueError(f"4-bit groups must hold an even number of k, got {group}")
        qp = panel_rows(q.to(torch.uint8))  # [P, 16, K]
        data = (qp[:, :, 0::2] | (qp[:, :, 1::2] << 4)).transpose(1, 2).contiguous()  # [P, K / 2, 16]
    else:
        data = panel_rows(q.to(torch.int8)).transpose(1, 2).contiguous()  # [P, K, 16]
    k_major = lambda t: panel_rows(t).transpose(1, 2).contiguous()  # noqa: E731  [P, K // group, 16]
    empty = scale.new_empty((0,))
    return PackedWeight(data, k_major(scale), empty if min is None else k_major(min.to(scale.dtype)), bits, group, n)


def unpack_ints(w: PackedWeight) -> torch.Tensor:
    """The integers q [n, K] int16 back in row order."""
    if w.bits == 4:
        d = w.data.to(torch.int16)  # [P, K / 2, 16]
        q = torch.stack([d & 15, d >> 4], dim=2).flatten(1, 2)  # [P, K, 16]
    else:
        q = w.data.to(torch.int16)
    return q.transpose(1, 2).reshape(-1, q.shape[1])[: w.n]


def _per_k(t: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """[P, K // group, 16] -> [n, K] float32, each group's value repeated over its k."""
    rows = t.transpose(1, 2).reshape(-1, t.shape[1])[: w.n].float()  # [n, K // group]
    return rows.repeat_interleave(w.group, dim=1)


def dequantize_reference(w: PackedWeight) -> torch.Tensor:
    """W [n, K] float32 in pure torch: q * scale, then + min (the order the kernel and the GGUF
    dequantizer use, so the values are bit-identical)."""
    out = unpack_ints(w).float() * _per_k(w.scale, w)
    if w.min.numel():
        out = out + _per_k(w.min, w)
    return out


def dequantize_t_reference(w: PackedWeight) -> torch.Tensor:
    """W.T float32 [K, P * 16] (what packed_dequantize_t returns): the padding rows past n are 0."""
    wt = dequantize_reference(w).T  # [K, n]
    return F.pad(wt, (0, w.data.shape[0] * PANEL - w.n)).contiguous()


def packed_linear_reference(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [M, K] -> [M, n] in float64 (the tests' reference)."""
    return x.double() @ dequantize_reference(w).double().T


def packed_linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (any float dtype) -> [..., n] in x's dtype.
    NOTE: called ~4 times a layer at decode, where each Python step here costs ~0.5 us of a ~30 us call:
    the 2-D float32 CPU case takes no reshape, conversion or view."""
    flat = x.dim() == 2
    x2 = x if flat else x.reshape(-1, x.shape[-1])  # [M, K]
    if x2.dtype != torch.float32:
        x2 = x2.float()
    if _KERNEL and x.is_cpu:
        if x2.shape[0] >= BLAS_MIN_ROWS and _DEQUANTIZE_T is not None:
            y = _gemm(x2, w)
        else:
            kernel = _KERNEL_BF16 if w.gemm_dtype == torch.bfloat16 and _KERNEL_BF16 is not None else _KERNEL
            y = kernel(x2, w.data, w.scale, w.min, w.bits, w.group, w.n)
    elif _CUDA_KERNEL and x.device.type == "cuda":
        if x2.shape[0] >= CUDA_BLAS_MIN_ROWS:
            y = _gemm(x2, w)
        else:
            y = _KERNEL(x2, w.data, w.scale, w.min, w.bits, w.group, w.n)
    else:  # NOTE: no kernel for this device (the engine refuses packed there): dequantize per call
        y = x2 @ dequantize_reference(w).T
    if bias is not None:
        y = y + bias.float()
    if x.dtype != torch.float32:
        y = y.to(x.dtype)
    return y if flat else y.view(*x.shape[:-1], w.n)


def _gemm(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [M, K] float32 @ W.T -> [M, n] float32, W dequantized for the call and multiplied in
    w.gemm_dtype (BLAS, cuBLAS)."""
    args = (w.data, w.scale, w.min, w.bits, w.group, w.n)
    if w.gemm_dtype == torch.float32:
        return x @ _DEQUANTIZE_T(*args)[:, : w.n]  # [M, K] @ [K, n]
    if _DEQUANTIZE_T_BF16 is not None and x.device.type == "cpu":
        wt = _DEQUANTIZE_T_BF16(*args)[:, : w.n]  # [K, n] bfloat16
    else:
        wt = _DEQUANTIZE_T(*args)[:, : w.n].to(w.gemm_dtype)
    return (x.to(w.gemm_dtype) @ wt).float()  # NOTE: torch's CPU mm has no float32 out for bf16 inputs


def bf16_gemm_native(device: torch.device) -> bool:
    """This device multiplies bfloat16 in hardware: a GPU, or a CPU with AVX512-BF16 or AMX
    (elsewhere oneDNN emulates it, slower than float32)."""
    if device.type != "cpu":
        return True
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(probe() for probe in probes if probe is not None)


def with_gemm_dtype(tree, dtype: torch.dtype) -> int:
    """Sets gemm_dtype on every PackedWeight inside `tree` (dataclasses, lists, dicts, in place);
    returns how many it set."""
    count = 0

    def swap(obj):
        nonlocal count
        if isinstance(obj, PackedWeight):
            count += 1
            return replace(obj, gemm_dtype=dtype)
        if is_dataclass(obj) and not isinstance(obj, type):
            for f in fields(obj):
                setattr(obj, f.name, swap(getattr(obj, f.name)))
        elif isinstance(obj, list):
            obj[:] = [swap(x) for x in obj]
        elif isinstance(obj, dict):
            for k in obj:
                obj[k] = swap(obj[k])
        return obj

    swap(tree)
    return count


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a dense weight, packed_linear for a packed one."""
    if isinstance(w, PackedWeight):
        return packed_linear(x, w, bias)
    return F.linear(x, w, bias)


def weight_slice(w, lo: int, hi: int):
    """Output rows lo..hi-1 of a dense or packed weight."""
    return w.rows(lo, hi) if isinstance(w, PackedWeight) else w[lo:hi]


def weight_rows(w, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` [N] of a weight as dtype [N, K] (an embedding lookup; a tied head's table may
    be packed)."""
    if not isinstance(w, PackedWeight):
        return w[ids]
    p, j = ids // PANEL, ids % PANEL
    if w.bits == 4:
        byte = w.data[p, :, j].to(torch.int16)  # [N, K / 2]
        q = torch.stack([byte & 15, byte >> 4], dim=2).flatten(1)  # [N, K]
    else:
        q = w.data[p, :, j].to(torch.int16)
    per_k = lambda t: t[p, :, j].float().repeat_interleave(w.group, dim=1)  # noqa: E731  [N, K]
    out = q.float() * per_k(w.scale)
    if w.min.numel():
        out = out + per_k(w.min)
    return out.to(dtype)
