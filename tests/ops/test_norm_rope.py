"""rms_norm_rope: the one-pass CPU kernel against its rounding emulated in float64 (bit for bit), against
the tensor-op reference (within one rounding) and against a float64 loop of the norm and rotation."""

from __future__ import annotations

import math

import pytest
import torch

from ridgefill_runtime.ops import norm_rope as nr
from ridgefill_runtime.layers.rotary import inverse_frequencies
from ridgefill_runtime.ops.norm_rope import norm_rope, norm_rope_reference
from ridgefill_runtime.ops.rms_norm import rms_norm

needs_kernel = pytest.mark.skipif(not nr._CPU_KERNEL, reason="the compiled extension has no CPU rms_norm_rope")


def inputs(n: int, heads: int, d: int, seed: int = 0, row_stride: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    width = row_stride or heads * d
    base = torch.randn(n, width, generator=gen) * 3.0  # [N, width]
    x = base[:, : heads * d].view(n, heads, d)  # rows at stride `width`, as q and k slice the fused output
    weight = 1.0 + 0.5 * torch.randn(d, generator=gen)
    angles = torch.rand(n, 1, d // 2, generator=gen) * 100.0  # [N, 1, D/2]
    return x, weight, angles.cos(), angles.sin()


def float64_loop(x, weight, cos, sin, eps):
    """Per head row in Python floats: normalise (when weight is given), then rotate half."""
    n, heads, d = x.shape
    out = torch.empty(n, heads, d, dtype=torch.float64)
    for i in range(n):
        c, s = cos[i, 0].double().tolist(), sin[i, 0].double().tolist()
        for h in range(heads):
            row = x[i, h].double().tolist()
            if weight is not None:
                inv = 1.0 / math.sqrt(math.fsum(v * v for v in row) / d + eps)
                row = [v * inv * w for v, w in zip(row, weight.double().tolist())]
            half = d // 2
            for j in range(half):
                a, b = row[j], row[j + half]
                out[i, h, j] = a * c[j] - b * s[j]
                out[i, h, j + half] = b * c[j] + a * s[j]
    return out


def rounded_rotation(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The kernel's rounding, emulated in float64: lo = fl32(fl32(y1 c) - y2 s), hi = fl32(fl32(y2 c) + y1 s)
    (each float32 product is exact in float64; torch's mul then addcmul round this way on x86)."""
    half = y.shape[-1] // 2
    y1, y2, c, s = y[..., :half].double(), y[..., half:].double(), cos.double(), sin.double()
    f32 = lambda t: t.float().double()  # noqa: E731
    return torch.cat([f32(f32(y1 * c) - y2 * s), f32(f32(y2 * c) + y1 * s)], dim=-1).float()


@needs_kernel
@pytest.mark.parametrize(
    "n,heads,d,stride", [(1, 4, 256, None), (1, 1, 256, 2048), (3, 6, 128, 1000), (17, 2, 64, None)]
)
@pytest.mark.parametrize("with_norm", [True, False])
def test_kernel_rounds_as_specified(n, heads, d, stride, with_norm):
    x, weight, cos, sin = inputs(n, heads, d, row_stride=stride)
    w = weight if with_norm else None
    normed = rms_norm(x, weight, 1e-6) if with_norm else x  # the norm: rms_norm's own kernel, bit for bit
    fused = torch.ops.ridgefill.rms_norm_rope(x, w, cos, sin, 1e-6)
    assert torch.equal(fused, rounded_rotation(normed, cos, sin))
    assert torch.equal(norm_rope(x, cos, sin, w, 1e-6), fused)
    # the tensor-op reference: within one rounding of it everywhere (the same bits where addcmul is an FMA)
    torch.testing.assert_close(fused, norm_rope_reference(x, cos, sin, w, 1e-6), rtol=2**-23, atol=1e-6)


@pytest.mark.parametrize("with_norm", [True, False])
def test_against_float64(with_norm):
    x, weight, cos, sin = inputs(5, 3, 64, seed=1, row_stride=250)
    w = weight if with_norm else None
    expected = float64_loop(x, w, cos, sin, 1e-6)
    for out in (norm_rope(x, cos, sin, w, 1e-6), norm_rope_reference(x, cos, sin, w, 1e-6)):
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_rope_angles_of_a_real_base():
    """cos/sin of real positions under a real base (the [N, 1, D/2] rows RotaryTable.lookup gives)."""
    angles = torch.tensor([0.0, 5.0, 63.0])[:, None] * inverse_frequencies(64, 10000.0, None)[None, :]  # [3, 32]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    x, weight, _, _ = inputs(3, 2, 64, seed=2)
    expected = float64_loop(x, weight, cos, sin, 1e-6)
    torch.testing.assert_close(norm_rope(x, cos, sin, weight, 1e-6).double(), expected, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_bad_input_names_the_cause():
    x, weight, cos, sin = inputs(2, 2, 64)
    with pytest.raises(RuntimeError, match="cos and sin must hold"):
        torch.ops.ridgefill.rms_norm_rope(x, weight, cos[:1], sin[:1], 1e-6)
    with pytest.raises(RuntimeError, match="weight must be float32 \\[D\\]"):
        torch.ops.ridgefill.rms_norm_rope(x, weight[:32], cos, sin, 1e-6)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.ridgefill.rms_norm_rope(x.double(), weight, cos, sin, 1e-6)
