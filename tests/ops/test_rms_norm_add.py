"""rms_norm_add: the one-pass CPU kernel against the tensor ops it replaces (bit for bit in float32) and
against a float64 loop."""

from __future__ import annotations

import math

import pytest
import torch


from ridgefill_runtime.ops.rms_norm import _ADD_KERNEL, rms_norm_add, rms_norm_add_reference, rms_norm_reference

needs_kernel = pytest.mark.skipif(not _ADD_KERNEL, reason="the compiled extension has no CPU rms_norm_add")


def inputs(n: int, d: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    y, residual = torch.randn(n, d, generator=gen) * 3.0, torch.randn(n, d, generator=gen)
    weight, next_weight = 1.0 + 0.5 * torch.randn(d, generator=gen), 1.0 + 0.5 * torch.randn(d, generator=gen)
    return y, residual, weight, next_weight


def float64_loop(y, residual, eps, weight, next_weight):
    def norm(row, w):
        inv = 1.0 / math.sqrt(math.fsum(v * v for v in row) / len(row) + eps)
        return [v * inv * wi for v, wi in zip(row, w)]

    sums, normed = [], []
    for yr, rr in zip(y.double().tolist(), residual.double().tolist()):
        add = yr if weight is None else norm(yr, weight.double().tolist())
        total = [a + b for a, b in zip(rr, add)]
        sums.append(total)
        normed.append(norm(total, next_weight.double().tolist()) if next_weight is not None else [])
    return torch.tensor(sums, dtype=torch.float64), torch.tensor(normed, dtype=torch.float64)


CASES = [(True, True), (False, True), (True, False), (False, False)]  # (weight, next_weight) given


@needs_kernel
@pytest.mark.parametrize("n,d", [(1, 640), (3, 896), (40, 64)])
@pytest.mark.parametrize("with_weight,with_next", CASES)
def test_kernel_is_the_tensor_ops_bit_for_bit(n, d, with_weight, with_next):
    y, residual, weight, next_weight = inputs(n, d)
    w, nw = (weight if with_weight else None), (next_weight if with_next else None)
    total, normed = torch.ops.ridgefill.rms_norm_add(y, w, residual, nw, 1e-6)
    ref_total, ref_normed = rms_norm_add_reference(y, residual, 1e-6, w, nw)  # rms_norm's kernel, then +
    assert torch.equal(total, ref_total) and torch.equal(normed, ref_normed)
    assert all(torch.equal(a, b) for a, b in zip(rms_norm_add(y, residual, 1e-6, w, nw), (total, normed)))
    if not with_next:
        assert normed.numel() == 0


@pytest.mark.parametrize("with_weight,with_next", CASES)
def test_against_float64(with_weight, with_next):
    y, residual, weight, next_weight = inputs(4, 96, seed=1)
    w, nw = (weight if with_weight else None), (next_weight if with_next else None)
    want_total, want_normed = float64_loop(y, residual, 1e-6, w, nw)
    total, normed = rms_norm_add(y, residual, 1e-6, w, nw)
    torch.testing.assert_close(total.double(), want_total, rtol=1e-5, atol=1e-5)
    if with_next:
        torch.testing.assert_close(normed.double(), want_normed, rtol=1e-5, atol=1e-5)
    # and the pure-torch norm gives the same within rounding
    pure = residual + (y if w is None else rms_norm_reference(y, w, 1e-6))
    torch.testing.assert_close(total, pure, rtol=1e-6, atol=1e-6)


def test_other_dtypes_take_the_tensor_ops():
    y, residual, weight, next_weight = inputs(2, 64)
    y16, r16, w16, n16 = (t.to(torch.bfloat16) for t in (y, residual, weight, next_weight))
    total, normed = rms_norm_add(y16, r16, 1e-6, w16, n16)
    ref_total, ref_normed = rms_norm_add_reference(y16, r16, 1e-6, w16, n16)
    assert total.dtype == torch.bfloat16 and torch.equal(total, ref_total) and torch.equal(normed, ref_normed)


@needs_kernel
def test_bad_input_names_the_cause():
    y, residual, weight, next_weight = inputs(2, 64)
    with pytest.raises(RuntimeError, match="same \\[N, d\\]"):
        torch.ops.ridgefill.rms_norm_add(y, weight, residual[:1], next_weight, 1e-6)
    with pytest.raises(RuntimeError, match="weights must be float32 \\[d\\]"):
        torch.ops.ridgefill.rms_norm_add(y, weight[:32], residual, next_weight, 1e-6)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.ridgefill.rms_norm_add(y.double(), weight, residual.double(), None, 1e-6)
