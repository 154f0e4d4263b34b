"""int8_map_gemm and the groupwise int8 quantizer against float64 loops.

Error model for the reference (fp32 GEMM, one final rounding to x's dtype): for y = Σ_k x_k ŵ_k + b,
|y_ref − y_exact| <= (K + 2) · 2^-24 · (Σ_k |x_k ŵ_k| + |b|) + u · |y_exact|, with u the output unit
roundoff (0 for float32). The bound is derived, not tuned.
"""

from __future__ import annotations

import math

import pytest
import torch

from ridgefill_runtime import ops
from ridgefill_runtime.ops import (
    dequantize_int8_groupwise,
    int8_map_gemm,
    int8_map_gemm_reference,
    quantize_int8_groupwise,
)

UNIT_ROUNDOFF = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
DTYPES = list(UNIT_ROUNDOFF)


def make_inputs(m, d_in, d_out, dtype, device="cpu", seed=0, with_bias=True):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(d_out, d_in, generator=gen) * torch.rand(d_out, 1, generator=gen)  # row-varying scale
    qweight, scales = quantize_int8_groupwise(w)
    x = torch.randn(m, d_in, generator=gen).to(dtype)
    bias = (torch.randn(d_out, generator=gen) * 0.5).to(torch.bfloat16) if with_bias else None

    def to(t):
        return None if t is None else t.to(device)

    return to(x), to(qweight), to(scales), to(bias)


def naive_f64(x, qweight, scales, bias):
    """y[m][n] = fsum_k x[m,k] * q[n,k] * s[n, k//128] + b[n], every product exact in float64."""
    xs, qs, ss = x.double().tolist(), qweight.tolist(), scales.double().tolist()
    bs = bias.double().tolist() if bias is not None else [0.0] * qweight.shape[0]
    y, mag = [], []
    for row in xs:
        y_row, m_row = [], []
        for n, (q_row, s_row) in enumerate(zip(qs, ss)):
            terms = [xv * qv * s_row[k // 128] for k, (xv, qv) in enumerate(zip(row, q_row))]
            y_row.append(math.fsum(terms) + bs[n])
            m_row.append(math.fsum(abs(t) for t in terms) + abs(bs[n]))
        y.append(y_row)
        mag.append(m_row)
    shape = (x.shape[0], qweight.shape[0])
    return torch.tensor(y, dtype=torch.float64).reshape(shape), torch.tensor(mag, dtype=torch.float64).reshape(shape)


def assert_close_bound(out, exact, magnitude, d_in, dtype):
    bound = (d_in + 2) * 2.0**-24 * magnitude + UNIT_ROUNDOFF[dtype] * exact.abs() + 1e-30
    err = (out.double().cpu() - exact).abs()
    worst = (err / bound).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"error exceeds the derived bound by {worst:.3f}x"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("m", "d_in", "d_out"), [(1, 128, 1), (3, 256, 5), (9, 384, 33), (2, 128, 7)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_reference_matches_naive_f64(m, d_in, d_out, dtype, with_bias):
    x, qweight, scales, bias = make_inputs(m, d_in, d_out, dtype, seed=m + d_out, with_bias=with_bias)
    out = int8_map_gemm_reference(x, qweight, scales, bias)
    assert out.dtype == dtype and out.shape == (m, d_out)
    exact, magnitude = naive_f64(x, qweight, scales, bias)
    assert_close_bound(out, exact, magnitude, d_in, dtype)


def test_empty_rows_and_wrapper_leading_dims():
    x, qweight, scales, bias = make_inputs(6, 256, 4, torch.float32, seed=3)
    assert int8_map_gemm(x[:0], qweight, scales, bias).shape == (0, 4)
    y3 = int8_map_gemm(x.view(2, 3, 256), qweight, scales, bias)
    assert y3.shape == (2, 3, 4)
    torch.testing.assert_close(y3.view(6, 4), int8_map_gemm_reference(x, qweight, scales, bias), rtol=0, atol=0)


def test_group_scales_apply_to_their_own_128_columns():
    # A map whose second group has a 1000x larger scale: swapping groups in the
    # kernel or reference (an off-by-one in k // 128) would show immediately.
    w = torch.zeros(2, 256)
    w[:, :128] = 0.001
    w[:, 128:] = 1.0
    qweight, scales = quantize_int8_groupwise(w)
    x = torch.zeros(1, 256)
    x[0, 127] = 1.0  # reads group 0 only
    y = int8_map_gemm_reference(x, qweight, scales)
    torch.testing.assert_close(y, torch.full((1, 2), 0.001), rtol=2e-3, atol=0)


# ---------------------------------------------------------------------------
# Quantizer round trip.


@pytest.mark.parametrize("seed", range(3))
def test_quantize_round_trip_bound(seed):
    gen = torch.Generator().manual_seed(seed)
    # Magnitudes over many binades, plus outliers, so bf16 scale rounding varies.
    w = torch.randn(17, 384, generator=gen) * torch.exp(4 * torch.randn(17, 3, generator=gen)).repeat_interleave(128, 1)
    w[3, 5] = 1e4
    qweight, scales = quantize_int8_groupwise(w)
    assert qweight.dtype == torch.int8 and scales.dtype == torch.bfloat16 and scales.shape == (17, 3)
    assert int(qweight.abs().max()) <= 127
    exact_scale = w.view(17, 3, 128).abs().amax(-1).double() / 127  # [17, 3]
    s_hat = scales.double()
    # ŝ is absmax/127 rounded up to bf16: never below it, at most one bf16 ulp (2^-7 relative) above.
    assert bool((s_hat >= exact_scale).all())
    assert bool((s_hat <= exact_scale * (1 + 2.0**-7)).all())
    w_hat = dequantize_int8_groupwise(qweight, scales).double()
    err = (w.double() - w_hat).abs().view(17, 3, 128)
    assert bool((err <= s_hat[..., None] / 2 * (1 + 2.0**-16)).all())
    # ... and therefore the documented bound in terms of the group's absmax.
    assert bool((err <= (exact_scale * (1 + 2.0**-7) / 2 * (1 + 2.0**-16))[..., None]).all())
    # The bound is not loose: random data comes close to half a step.
    assert float((err / s_hat[..., None]).max()) > 0.45
    # The group's largest weight is representable up to the scale rounding: q = ±127 there.
    assert int(qweight[3].abs().max()) == 127


def test_quantize_zero_group_and_exactly_representable():
    w = torch.zeros(2, 256)
    w[1, 128:] = torch.arange(-64, 64, dtype=torch.float32) * 0.5  # multiples of an exact scale
    qweight, scales = quantize_int8_groupwise(w)
    assert float(scales[0, 0]) == 0.0 and int(qweight[0].abs().max()) == 0
    w_hat = dequantize_int8_groupwise(qweight, scales)
    assert torch.equal(w_hat[0], w[0])
    assert float((w_hat[1] - w[1]).abs().max()) <= float(scales[1, 1]) / 2


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="d_in % 128"):
        quantize_int8_groupwise(torch.randn(3, 100))
    with pytest.raises(ValueError, match="finite"):
        quantize_int8_groupwise(torch.full((1, 128), float("inf")))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(d_in=100), ValueError, "multiple of 128"),
        (dict(x_dtype=torch.float64), TypeError, "unsupported x dtype"),
        (dict(q_dtype=torch.uint8), TypeError, "int8"),
        (dict(scale_dtype=torch.float32), TypeError, "bfloat16"),
        (dict(scale_cols=1), ValueError, "scales must be"),
        (dict(bias_len=3), ValueError, "bias must be"),
    ],
)
def test_rejects_bad_arguments(kwargs, error, match):
    d_in = kwargs.get("d_in", 256)
    x = torch.randn(2, d_in, dtype=kwargs.get("x_dtype", torch.float32))
    qweight = torch.zeros(4, d_in, dtype=kwargs.get("q_dtype", torch.int8))
    scales = torch.ones(
        4, kwargs.get("scale_cols", max(d_in // 128, 1)), dtype=kwargs.get("scale_dtype", torch.bfloat16)
    )
    bias = torch.zeros(kwargs.get("bias_len", 4), dtype=torch.bfloat16)
    with pytest.raises(error, match=match):
        int8_map_gemm(x, qweight, scales, bias)


# ---------------------------------------------------------------------------
# CUDA kernel (GEMV path for M <= 8, tensor-core path above for bf16/fp16).


def _kernel(x, qweight, scales, bias):
    assert ops.extension_loaded(), f"CUDA available but extension not loaded: {ops.extension_error()}"
    torch.full((x.shape[0], qweight.shape[0]), float("nan"), dtype=x.dtype, device=x.device)  # poison the pool
    return torch.ops.ridgefill.int8_map_gemm(x, qweight, scales, bias)


def _exact_f64(x, qweight, scales, bias):
    w = dequantize_int8_groupwise(qweight, scales).double()  # exact
    y = x.double() @ w.T
    return y + bias.double() if bias is not None else y


def _torch_lowp(x, qweight, scales, bias):
    """What torch gets in x's dtype with the weights dequantized to that dtype (cuBLAS GEMM)."""
    w = dequantize_int8_groupwise(qweight, scales).to(x.dtype)
    y = x @ w.T
    return y + bias.to(x.dtype) if bias is not None else y


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("m", "d_in", "d_out"),
    [(1, 128, 1), (5, 384, 77), (8, 1024, 513), (9, 256, 130), (67, 640, 300), (300, 2048, 1024), (2048, 1024, 2048)],
)
def test_kernel_matches_exact(m, d_in, d_out, dtype):
    for seed in range(2):  # fresh inputs each run
        x, qweight, scales, bias = make_inputs(m, d_in, d_out, dtype, device="cuda", seed=seed + 10 * m)
        out = _kernel(x, qweight, scales, bias)
        assert out.shape == (m, d_out) and out.dtype == dtype and out.is_contiguous()
        exact = _exact_f64(x, qweight, scales, bias)
        err = (out.double() - exact).abs().max().item()
        if dtype == torch.float32:
            # fp32 accumulation over d_in terms: same derived bound as the reference.
            magnitude = x.double().abs() @ dequantize_int8_groupwise(qweight, scales).double().abs().T
            bound = ((d_in + 2) * 2.0**-24 * (magnitude + bias.double().abs())).max().item()
            assert err <= bound, (err, bound)
        else:
            torch_err = (_torch_lowp(x, qweight, scales, bias).double() - exact).abs().max().item()
            floor = UNIT_ROUNDOFF[dtype] * exact.abs().max().item()
            assert err <= 2 * torch_err + floor, (err, torch_err, floor)


@pytest.mark.gpu
def test_kernel_misaligned_and_strided_x():
    x, qweight, scales, bias = make_inputs(20, 256, 40, torch.bfloat16, device="cuda", seed=5)
    base = torch.randn(20 * 256 + 1, device="cuda").to(torch.bfloat16)
    x_odd = base[1:].view(20, 256)  # data pointer 2 bytes off a 16-byte boundary
    x_odd.copy_(x)
    for xx in (x_odd, x_odd[:3], x.t().contiguous().t()):
        torch.testing.assert_close(_kernel(xx, qweight, scales, bias), _kernel(xx.contiguous(), qweight, scales, bias))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [3, 40])
def test_kernel_opcheck(dtype, m):
    x, qweight, scales, bias = make_inputs(m, 256, 24, dtype, device="cuda", seed=6)
    torch.library.opcheck(torch.ops.ridgefill.int8_map_gemm.default, (x, qweight, scales, bias))
    torch.library.opcheck(torch.ops.ridgefill.int8_map_gemm.default, (x, qweight, scales, None))


@pytest.mark.gpu
def test_wrapper_dispatches_to_kernel_on_cuda():
    x, qweight, scales, bias = make_inputs(4, 128, 8, torch.bfloat16, device="cuda", seed=7)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        int8_map_gemm(x, qweight, scales, bias)
    assert sum(e.name == "ridgefill::int8_map_gemm" for e in prof.events()) == 1
