"""RMSNorm: torch reference and CUDA kernel against an exact float64 model.

Tolerances come from the rounding steps of the HF convention rather than
being tuned: the fp32-normalised value is rounded to the input dtype, then the
product with the weight (exact in fp32 for 16-bit inputs) is rounded again, so
each output is within 2u (+u^2) of the exact value, u = unit roundoff.
"""

from __future__ import annotations

import math

import pytest
import torch

from ridgefill_runtime import ops
from ridgefill_runtime.ops import rms_norm, rms_norm_reference

# (rtol, atol) vs. the exact float64 result. u = 2^-8 (bf16), 2^-11 (fp16);
# fp32 allows for the fp32 sum of squares over up to ~4k elements.
TOLERANCES = {
    torch.float32: (2e-6, 1e-7),
    torch.bfloat16: (2 * 2.0**-8 * 1.01, 0.0),
    torch.float16: (2 * 2.0**-11 * 1.01, 0.0),
}
DTYPES = list(TOLERANCES)
SHAPES = [(1, 1), (3, 5), (7, 127), (2, 3, 1000), (5, 4097)]


def naive_rms_norm_f64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Row-by-row in Python floats (float64), no intermediate rounding."""
    rows = x.reshape(-1, x.shape[-1]).double().tolist()
    w = weight.double().tolist()
    out = []
    for row in rows:
        mean_sq = math.fsum(v * v for v in row) / len(row)
        inv_rms = 1.0 / math.sqrt(mean_sq + eps)
        out.append([v * inv_rms * wi for v, wi in zip(row, w)])
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape)


def make_inputs(shape, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3.0).to(dtype)
    weight = (1.0 + 0.5 * torch.randn(shape[-1], generator=gen)).to(dtype)
    return x.to(device), weight.to(device)


def assert_close_to_exact(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    rtol, atol = TOLERANCES[x.dtype]
    expected = naive_rms_norm_f64(x.cpu(), weight.cpu(), eps)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("eps", [1e-6, 0.1])  # 0.1 is large enough to matter
def test_reference_matches_exact(shape, dtype, eps):
    x, weight = make_inputs(shape, dtype)
    out = rms_norm_reference(x, weight, eps)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close_to_exact(out, x, weight, eps)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_is_bitwise_hf_llama(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, weight = make_inputs((4, 257), dtype, seed=1)
    hf = LlamaRMSNorm(257, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(weight)
        expected = hf(x)
    torch.testing.assert_close(rms_norm_reference(x, weight, 1e-5), expected, rtol=0, atol=0)


def test_convention_is_distinguishable_in_bf16():
    # Shows the bitwise HF test has teeth: weighting before the cast to bf16
    # (the tempting alternative) rounds differently on a visible fraction.
    x, weight = make_inputs((8, 512), torch.bfloat16, seed=2)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)
    weight_first = (normed * weight.float()).to(torch.bfloat16)
    assert (weight_first != rms_norm_reference(x, weight, 1e-5)).float().mean() > 0.01


def test_zero_rows_stay_finite():
    x = torch.zeros(2, 16)
    out = rms_norm_reference(x, torch.ones(16), 1e-6)
    assert torch.equal(out, torch.zeros(2, 16))


@pytest.mark.parametrize(
    ("x", "weight", "error"),
    [
        (torch.randn(2, 8), torch.randn(7), ValueError),
        (torch.randn(2, 8), torch.randn(1), ValueError),  # would broadcast
        (torch.randn(2, 8), torch.randn(2, 8), ValueError),
        (torch.randn(2, 8), torch.randn(8, dtype=torch.bfloat16), TypeError),
        (torch.randn(2, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64), TypeError),
    ],
)
def test_reference_rejects_bad_arguments(x, weight, error):
    with pytest.raises(error, match="rms_norm"):
        rms_norm(x, weight, 1e-6)


def _ridgefill_op_calls(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for event in prof.events() if event.name == "ridgefill::rms_norm")


def test_wrapper_uses_the_cpu_kernel_where_built():
    x, weight = make_inputs((3, 64), torch.float32)
    built = ops.extension_loaded() and torch._C._dispatch_has_kernel_for_dispatch_key("ridgefill::rms_norm", "CPU")
    assert _ridgefill_op_calls(lambda: rms_norm(x, weight, 1e-6)) == (1 if built else 0)
    assert_close_to_exact(rms_norm(x, weight, 1e-6), x, weight, 1e-6)


@pytest.mark.skipif(not ops.extension_loaded(), reason="compiled extension not built")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (7, 33), (2, 3, 1024), (0, 64)])
def test_cpu_kernel_matches_float64_and_the_reference(dtype, shape):
    x, weight = make_inputs(shape, dtype)
    out = torch.ops.ridgefill.rms_norm(x, weight, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close_to_exact(out, x, weight, 1e-5)
    ref = rms_norm_reference(x, weight, 1e-5)
    # float32 sums in another order: a few ulps of the reference, in the output dtype
    torch.testing.assert_close(out, ref, rtol=4 * torch.finfo(dtype).eps, atol=4 * torch.finfo(dtype).eps)


def test_float64_is_refused_on_every_path():
    x, weight = make_inputs((2, 64), torch.float32)
    with pytest.raises(TypeError, match="unsupported dtype"):
        rms_norm(x.double(), weight.double(), 1e-6)  # the contract names float32/bfloat16/float16


# --------------------------------------------------------------------------
# CUDA kernel. On a CUDA machine the extension must be there: comparing the
# reference with itself would pass vacuously.


def _kernel(x, weight, eps):
    assert ops.extension_loaded(), f"CUDA available but extension not loaded: {ops.extension_error()}"
    # Poison the caching allocator: the output is likely to reuse this NaN
    # block, so elements the kernel fails to write show up as NaN.
    torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device)
    return torch.ops.ridgefill.rms_norm(x, weight, eps)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES + [(3, 8192), (1, 1025), (300, 64)], ids=str)
def test_kernel_matches_exact_and_reference(shape, dtype):
    for seed in range(2):  # fresh inputs: stale outputs cannot match twice
        x, weight = make_inputs(shape, dtype, device="cuda", seed=seed)
        out = _kernel(x, weight, 1e-6)
        assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
        assert_close_to_exact(out, x, weight, 1e-6)
        if dtype != torch.float32:
            # Same rounding recipe as the reference, so 16-bit outputs agree
            # bitwise except where fp32 ulp noise (sum order, sqrt) meets a
            # rounding boundary: rare, not systematic. (fp32 results differ
            # in the last ulps, covered by the exact comparison above.)
            mismatches = int((out != rms_norm_reference(x, weight, 1e-6)).sum())
            assert mismatches <= 1 + 0.01 * out.numel()


@pytest.mark.gpu
def test_kernel_strided_rows_and_empty():
    base, weight = make_inputs((6, 2, 300), torch.bfloat16, device="cuda", seed=3)
    x = base[:, 1]  # rows 600 elements apart, last dim contiguous
    assert not x.is_contiguous()
    assert_close_to_exact(_kernel(x, weight, 1e-5), x, weight, 1e-5)
    empty = torch.empty(0, 300, dtype=torch.bfloat16, device="cuda")
    assert _kernel(empty, weight, 1e-5).shape == (0, 300)


@pytest.mark.gpu
def test_kernel_rejects_bad_arguments():
    x, weight = make_inputs((4, 64), torch.float32, device="cuda")
    with pytest.raises(RuntimeError, match="last dim of x must be contiguous"):
        torch.ops.ridgefill.rms_norm(x.t().contiguous().t(), weight, 1e-6)
    with pytest.raises(RuntimeError, match="must match x dtype"):
        torch.ops.ridgefill.rms_norm(x, weight.half(), 1e-6)
    with pytest.raises(RuntimeError, match="weight is on"):
        torch.ops.ridgefill.rms_norm(x, weight.cpu(), 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_opcheck(dtype):
    x, weight = make_inputs((5, 1000), dtype, device="cuda", seed=4)
    torch.library.opcheck(torch.ops.ridgefill.rms_norm.default, (x, weight, 1e-5))


@pytest.mark.gpu
def test_wrapper_uses_kernel_on_cuda():
    x, weight = make_inputs((3, 64), torch.bfloat16, device="cuda")
    assert ops.extension_loaded(), ops.extension_error()
    assert _ridgefill_op_calls(lambda: rms_norm(x, weight, 1e-6)) == 1
