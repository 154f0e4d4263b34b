"""GGUF quantized weights re-expressed, exactly, as group-wise integers.

The runtime keeps GGUF's quantized weights packed instead of dequantizing them to float32, so it
needs one layout its kernels understand for every supported block type:

    weight[n, k] = q[n, k] * scale[n, k // group] + (min[n, k // group] or 0)

This module unpacks the raw blocks (numpy, whole tensors at once) into that form without changing
any dequantized value: `dequantize_groups` of the result equals gguf-py's dequantization of the
same tensor. Why each type is exact (all arithmetic float32, as gguf-py does it):

- Q8_0   q * d, the very product gguf-py takes.
- Q4_1   q * d + m, the same two operations in the same order.
- Q4_0   gguf-py takes (q - 8) * d; we take q * d + (-8 * d). Both products are exact (4 bits times
         an fp16's 11), so the sum is the exact (q - 8) * d too. -8 * d stays fp16 unless it
         overflows fp16 (|d| >= 8192); then scale and min are float32. The one difference is the
         sign of a zero: q == 8 with a negative d gives +0 here, -0 in gguf-py.
- Q5_0   (q - 16) * d, gguf-py's product: q - 16 (-16..15) is kept signed, with no min.
- Q4_K   scale = d * sc and min = -(dmin * m) per 32-value sub-block, both exact products (fp16
         times a 6-bit integer), then q * scale + min, which IEEE defines as q * scale - dmin * m.
- Q6_K   scale = d * sc per 16 values (exact), then q * scale: gguf-py's product, operands swapped.

The form itself, its reference dequantization and the row operations the loader and the model
need (fusing q/k/v, reordering rope rows) are in ops/grouped_ints.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

import numpy as np
import torch

from ..errors import ModelLoadError, UnsupportedError
from ..ops.grouped_ints import GroupedInts


# ---------------------------------------------------------------------------------------------
# Block decoders: uint8 blocks [B, bytes] -> (q [B, values], scale [B, values / group], min or None)
# ---------------------------------------------------------------------------------------------

Decoded = tuple[np.ndarray, np.ndarray, "np.ndarray | None"]


def _half(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The little-endian fp16 at byte `offset` of each block."""
    return np.ascontiguousarray(blocks[:, offset : offset + 2]).view("<f2")[:, 0]  # [B]


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., n] -> [..., 2, n]: every byte's low nibble, then every byte's high nibble."""
    return np.stack([packed & 0x0F, packed >> 4], axis=-2)


def _as_int8(values: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return values.reshape(shape).view(np.int8)  # uint8 values below 128 read the same as int8


def _decode_q8_0(blocks: np.ndarray) -> Decoded:
    # block_q8_0 { f16 d; int8 qs[32]; }  x = qs * d
    q = np.ascontiguousarray(blocks[:, 2:34]).view(np.int8)  # [B, 32]
    return q, _half(blocks, 0)[:, None], None  # scale [B, 1]


def _offset_by(q: np.ndarray, d: np.ndarray, offset: int) -> Decoded:
    """x = (q - offset) * d as q * d + (-offset * d): scale and min in fp16 while -offset * d is
    one, else both float32 (a power-of-two multiple of an fp16 is exact in float32)."""
    minimum = d.astype(np.float32) * np.float32(-offset)  # [B, 1], exact in float32
    with np.errstate(over="ignore"):
        as_half = minimum.astype(np.float16)  # overflows to inf once |offset * d| > 65504
    if np.array_equal(as_half.astype(np.float32), minimum, equal_nan=True):
        return q, d, as_half
    return q, d.astype(np.float32), minimum


def _decode_q4_0(blocks: np.ndarray) -> Decoded:
    # block_q4_0 { f16 d; u8 qs[16]; }  value j: low nibble of qs[j], j + 16: its high nibble; x = (q - 8) * d
    q = _as_int8(_nibbles(blocks[:, 2:18]), (len(blocks), 32))  # [B, 32] in 0..15
    return _offset_by(q, _half(blocks, 0)[:, None], 8)


_BIT = np.arange(32, dtype=np.uint32)  # [32]


def _decode_q5_0(blocks: np.ndarray) -> Decoded:
    # block_q5_0 { f16 d; u8 qh[4]; u8 qs[16]; }  value j: the nibbles as in Q4_0, with bit j of
    # the little-endian uint32 qh as its fifth bit; x = (q - 16) * d
    qh = np.ascontiguousarray(blocks[:, 2:6]).view("<u4")  # [B, 1]
    fifth = ((qh >> _BIT) & 1).astype(np.uint8)  # [B, 32]
    low = _nibbles(blocks[:, 6:22]).reshape(len(blocks), 32)  # [B, 32]
    q = _as_int8(low | (fifth << 4), (len(blocks), 32)) - np.int8(16)  # [B, 32] in -16..15
    # NOTE: signed, no min (unlike Q4_0, whose 4-bit layout is unsigned): 8.5 bits a weight in the
    # 8-bit layout instead of 9, and the product gguf-py takes, signs of zeros included
    return q, _half(blocks, 0)[:, None], None


def _decode_q4_1(blocks: np.ndarray) -> Decoded:
    # block_q4_1 { f16 d; f16 m; u8 qs[16]; }  nibbles as in Q4_0; x = q * d + m
    q = _as_int8(_nibbles(blocks[:, 4:20]), (len(blocks), 32))  # [B, 32] in 0..15
    return q, _half(blocks, 0)[:, None], _half(blocks, 2)[:, None]  # scale, min [B, 1]


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's eight 6-bit (scale, min) pairs from 12 bytes [B, 12] -> two uint8 [B, 8].

    Sub-blocks 0-3: low 6 bits of bytes 0-3 (scales) and 4-7 (mins). Sub-blocks 4-7: low / high
    nibble of bytes 8-11, with the top 2 bits of bytes 0-3 / 4-7 above them.
    """
    scale_bytes, min_bytes, nibble_bytes = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]  # [B, 4] each
    scales = np.concatenate([scale_bytes & 63, (nibble_bytes & 0x0F) | ((scale_bytes >> 6) << 4)], axis=1)
    mins = np.concatenate([min_bytes & 63, (nibble_bytes >> 4) | ((min_bytes >> 6) << 4)], axis=1)
    return scales, mins  # [B, 8], [B, 8]


def _decode_q4_k(blocks: np.ndarray) -> Decoded:
    # block_q4_K { f16 d; f16 dmin; u8 scales[12]; u8 qs[128]; }  8 sub-blocks of 32; each 32 bytes
    # of qs hold two: low nibbles, then high nibbles. x = (d * sc) * q - dmin * m
    d = _half(blocks, 0).astype(np.float32)[:, None]  # [B, 1]
    dmin = _half(blocks, 2).astype(np.float32)[:, None]  # [B, 1]
    sc, m = _k_scales(blocks[:, 4:16])  # [B, 8] each
    q = _as_int8(_nibbles(blocks[:, 16:144].reshape(-1, 4, 32)), (len(blocks), 256))  # [B, 256] in 0..15
    return q, d * sc.astype(np.float32), -(dmin * m.astype(np.float32))  # scale, min [B, 8]


_Q6_HIGH_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]  # [4, 1]


def _decode_q6_k(blocks: np.ndarray) -> Decoded:
    # block_q6_K { u8 ql[128]; u8 qh[64]; int8 scales[16]; f16 d; }  two halves of 128 values; in
    # half h, value 32 * j + l (j < 4, l < 32) takes its low 4 bits from ql[64h + l + 32 (j % 2)]
    # (low nibble for j < 2, high for j >= 2) and its top 2 bits from qh[32h + l] >> 2j; minus 32.
    low = blocks[:, 0:128].reshape(-1, 2, 2, 32)  # [B, half, j % 2, l]
    low4 = np.concatenate([low & 0x0F, low >> 4], axis=2)  # [B, half, j, l]
    high = blocks[:, 128:192].reshape(-1, 2, 1, 32)  # [B, half, 1, l]
    high2 = (high >> _Q6_HIGH_SHIFTS) & 3  # [B, half, j, l]
    q = _as_int8(low4 | (high2 << 4), (len(blocks), 256)) - np.int8(32)  # [B, 256] in -32..31
    sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8)  # [B, 16]
    d = _half(blocks, 208).astype(np.float32)[:, None]  # [B, 1]
    return q, d * sc.astype(np.float32), None  # scale [B, 16]


@dataclass(frozen=True)
class _Format:
    values: int  # weights per block
    nbytes: int  # bytes per block
    bits: int
    group: int
    decode: Callable[[np.ndarray], Decoded]


_FORMATS = {
    "Q8_0": _Format(32, 34, 8, 32, _decode_q8_0),
    "Q4_0": _Format(32, 18, 4, 32, _decode_q4_0),
    "Q5_0": _Format(32, 22, 8, 32, _decode_q5_0),  # NOTE: 5-bit q - 16 held in the 8-bit layout
    "Q4_1": _Format(32, 20, 4, 32, _decode_q4_1),
    "Q4_K": _Format(256, 144, 4, 32, _decode_q4_k),
    "Q6_K": _Format(256, 210, 8, 16, _decode_q6_k),
}

# GGUF tensor types grouped_from_gguf accepts (the others stay float weights or are refused).
GROUPABLE = tuple(_FORMATS)


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def grouped_from_gguf(tensor) -> GroupedInts:
    """The group-wise integers of a gguf-py ReaderTensor, rows in `dequantize_tensor`'s order."""
    type_name = tensor.tensor_type.name
    fmt = _FORMATS.get(type_name)
    if fmt is None:
        raise UnsupportedError(
            f"tensor {tensor.name!r} has type {type_name}, which cannot be kept as "
            f"group-wise integers (supported: {', '.join(GROUPABLE)})"
        )
    rows, cols = _rows_and_cols(tensor, fmt)
    blocks = np.asarray(tensor.data).reshape(-1, fmt.nbytes)  # [rows * cols / values, bytes]
    q, scale, minimum = fmt.decode(blocks)
    groups = (rows, cols // fmt.group)
    return GroupedInts(
        q=_to_torch(q, (rows, cols)),  # [N, K]
        scale=_to_torch(scale, groups),  # [N, K // group]
        min=None if minimum is None else _to_torch(minimum, groups),  # [N, K // group]
        bits=fmt.bits,
        group=fmt.group,
    )


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _rows_and_cols(tensor, fmt: _Format) -> tuple[int, int]:
    """(N, K) of a 2-D GGUF tensor; GGUF lists dimensions fastest first, so K is shape[0]."""
    dims = [int(d) for d in tensor.shape]
    if len(dims) != 2:
        raise UnsupportedError(
            f"tensor {tensor.name!r} has {len(dims)} dimensions; only 2-D "
            f"{tensor.tensor_type.name} weights can be kept as group-wise integers"
        )
    cols, rows = dims
    expected = rows * (cols // fmt.values) * fmt.nbytes
    if cols % fmt.values or np.asarray(tensor.data).size != expected:
        raise ModelLoadError(
            f"tensor {tensor.name!r}: {tensor.tensor_type.name} data does not fit its shape [{rows}, {cols}]"
        )
    return rows, cols


def _to_torch(values: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    # np.require copies only what is still a view of the reader's read-only memory map.
    return torch.from_numpy(np.require(values.reshape(shape), requirements=["C", "W"]))
