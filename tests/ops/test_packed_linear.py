"""packed_linear against a float64 product with the weights dequantized by hand, and the panel
layout against the integers it was packed from."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ridgefill_runtime.ops import op_available
from ridgefill_runtime.ops.packed_linear import (
    BLAS_MIN_ROWS,
    PackedWeight,
    dequantize_t_reference,
    dequantize_reference,
    linear,
    pack,
    packed_linear,
    unpack_ints,
    weight_rows,
    weight_slice,
)

needs_kernel = pytest.mark.skipif(not op_available("packed_linear"), reason="compiled extension not built")

# (bits, group, scale dtype, with a min): Q4_1 / Q4_0, Q8_0 and Q5_0, Q6_K, Q4_K as the loader repacks them,
# and 8 bits with an fp16 min (a fused projection of 8-bit and 4-bit-with-min parts)
FORMATS = [
    (4, 32, torch.float16, True),
    (8, 32, torch.float16, False),
    (8, 16, torch.float32, False),
    (4, 32, torch.float32, True),
    (8, 32, torch.float16, True),
]


def _random(n: int, k: int, bits: int, group: int, dtype, with_min: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lo, hi = (0, 16) if bits == 4 else (-128, 128)
    q = torch.randint(lo, hi, (n, k), generator=g)
    scale = (torch.rand(n, k // group, generator=g) * 0.02).to(dtype)
    mins = (torch.randn(n, k // group, generator=g) * 0.05).to(dtype) if with_min else None
    return q, scale, mins


def _by_hand(q, scale, mins, group) -> torch.Tensor:
    """W [n, K] float64: every weight computed alone, q * scale (+ min), in float32 as stored."""
    w = q.float() * scale.float().repeat_interleave(group, dim=1)
    if mins is not None:
        w = w + mins.float().repeat_interleave(group, dim=1)
    return w.double()


@pytest.mark.parametrize("bits,group,dtype,with_min", FORMATS)
def test_layout_round_trips(bits, group, dtype, with_min):
    q, scale, mins = _random(37, 64, bits, group, dtype, with_min)  # 37: a partial last panel
    w = pack(q, scale, mins, bits, group)
    assert torch.equal(unpack_ints(w), q.to(torch.int16))
    assert torch.equal(dequantize_reference(w).double(), _by_hand(q, scale, mins, group))
    assert w.shape == (37, 64)


@needs_kernel
@pytest.mark.parametrize("bits,group,dtype,with_min", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 100, BLAS_MIN_ROWS, 300])
def test_kernel_matches_float64(bits, group, dtype, with_min, rows):
    """Below BLAS_MIN_ROWS the in-register kernel, from there the BLAS route: both against float64."""
    n, k = 45, 128
    q, scale, mins = _random(n, k, bits, group, dtype, with_min, seed=rows)
    w = pack(q, scale, mins, bits, group)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7))
    want = x.double() @ _by_hand(q, scale, mins, group).T  # [rows, n]
    got = packed_linear(x, w)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    # float32 sums of k products: error ~ sqrt(k) ulps of the terms' magnitude
    bound = 1e-6 * (x.abs().double() @ _by_hand(q, scale, mins, group).abs().T) + 1e-7
    assert bool(((got.double() - want).abs() <= bound).all())


@pytest.mark.skipif(not op_available("packed_dequantize_t"), reason="compiled extension not built")
@pytest.mark.parametrize("bits,group,dtype,with_min", FORMATS)
def test_dequantize_t_gives_the_same_values(bits, group, dtype, with_min):
    """The BLAS route's weight: bit for bit the stored values (q * scale, then + min), transposed,
    the last panel's padding rows zero."""
    q, scale, mins = _random(37, 64, bits, group, dtype, with_min)
    w = pack(q, scale, mins, bits, group)
    got = torch.ops.ridgefill.packed_dequantize_t(w.data, w.scale, w.min, bits, group, w.n)
    assert got.shape == (64, 48) and got.dtype == torch.float32
    assert torch.equal(got, dequantize_t_reference(w))
    assert torch.equal(got[:, :37].double(), _by_hand(q, scale, mins, group).T)
    part = w.rows(16, 30)  # a fused projection's part: its last panel holds real rows past n
    got = torch.ops.ridgefill.packed_dequantize_t(part.data, part.scale, part.min, bits, group, part.n)
    assert torch.equal(got, dequantize_t_reference(part)) and not got[:, 14:].any()


@needs_kernel
def test_leading_dims_bias_and_bfloat16_input():
    q, scale, mins = _random(32, 64, 4, 32, torch.float16, True)
    w = pack(q, scale, mins, 4, 32)
    x = torch.randn(2, 3, 64)
    bias = torch.randn(32)
    want = (x.double().reshape(6, 64) @ _by_hand(q, scale, mins, 32).T + bias.double()).reshape(2, 3, 32)
    got = packed_linear(x, w, bias)
    assert got.shape == (2, 3, 32)
    assert torch.allclose(got.double(), want, atol=1e-5)
    got_bf16 = packed_linear(x.bfloat16(), w)
    assert got_bf16.dtype == torch.bfloat16


def test_rows_slice_and_lookup_match_the_dense_weight():
    q, scale, mins = _random(48, 64, 4, 32, torch.float16, True)
    w = pack(q, scale, mins, 4, 32)
    dense = dequantize_reference(w)
    assert torch.equal(dequantize_reference(weight_slice(w, 16, 40)), dense[16:40])
    ids = torch.tensor([0, 7, 8, 15, 16, 47, 3])
    assert torch.equal(weight_rows(w, ids, torch.float32), dense[ids])
    q8, s8, _ = _random(20, 64, 8, 32, torch.float16, False)
    w8 = pack(q8, s8, None, 8, 32)
    assert torch.equal(weight_rows(w8, torch.tensor([19, 0, 9]), torch.float32), dequantize_reference(w8)[[19, 0, 9]])
    with pytest.raises(ValueError, match="multiple of 16"):
        weight_slice(w, 8, 40)


def test_linear_dispatches_on_the_weight_kind():
    x = torch.randn(3, 64)
    dense = torch.randn(10, 64)
    assert torch.equal(linear(x, dense), torch.nn.functional.linear(x, dense))
    q, scale, _ = _random(10, 64, 8, 32, torch.float32, False)
    packed = pack(q, scale, None, 8, 32)
    assert isinstance(packed, PackedWeight)
    bias = torch.randn(10)
    assert torch.equal(linear(x, packed, bias), packed_linear(x, packed, bias))
    assert torch.allclose(linear(x, packed).double(), x.double() @ _by_hand(q, scale, None, 32).T, atol=1e-5)


def test_pack_refuses_values_out_of_range_and_bad_shapes():
    q, scale, _ = _random(16, 64, 4, 32, torch.float32, False)
    with pytest.raises(ValueError, match=r"4-bit values must lie in \[0, 15\]"):
        pack(q + 1, scale, None, 4, 32)
    with pytest.raises(ValueError, match="scale must be"):
        pack(q, scale[:, :1], None, 4, 32)
    with pytest.raises(ValueError, match="4 or 8 bits"):
        pack(q, scale, None, 5, 32)


@needs_kernel
def test_kernel_refuses_a_wrong_input_width():
    q, scale, _ = _random(16, 64, 4, 32, torch.float32, False)
    w = pack(q, scale, None, 4, 32)
    with pytest.raises(RuntimeError, match=r"x must be float32 \[M, 64\]"):
        torch.ops.ridgefill.packed_linear(torch.randn(2, 32), w.data, w.scale, w.min, 4, 32, 16)


_ISA_CHECK = textwrap.dedent("""
    import os
    import torch
    from ridgefill_runtime.ops.packed_linear import (BLAS_MIN_ROWS, dequantize_reference, dequantize_t_reference,
                                                     pack, packed_linear)
    g = torch.Generator().manual_seed(0)
    total = 0.0  # float64 sum of every output: tells the variants apart (each sums in its own order)
    formats = [(4, 32, torch.float16, True), (8, 32, torch.float16, False), (8, 16, torch.float32, False),
               (4, 32, torch.float32, True), (8, 32, torch.float16, True)]
    # K = 640: AVX2's many-row path dequantizes 256 k at a time (256 + 256 + 128)
    for (bits, group, dtype, with_min), K in [(f, K) for f in formats for K in (128, 640)]:
        lo, hi = (0, 16) if bits == 4 else (-128, 128)
        q = torch.randint(lo, hi, (45, K), generator=g)
        scale = (torch.rand(45, K // group, generator=g) * 0.02).to(dtype)
        mins = (torch.randn(45, K // group, generator=g) * 0.05).to(dtype) if with_min else None
        w = pack(q, scale, mins, bits, group)
        wd = dequantize_reference(w).double()
        for rows in (1, 2, 3, 4, 5, 7, 8, 9, 11, 12, 13, 14, 16, 17, 20, 33, BLAS_MIN_ROWS - 1):
            x = torch.randn(rows, K, generator=g)
            y = packed_linear(x, w).double()
            total += float(y.sum())
            err = (y - x.double() @ wd.T).abs()
            bound = 1e-6 * (x.abs().double() @ wd.abs().T) + 1e-7
            assert bool((err <= bound).all()), (bits, group, dtype, with_min, rows, float(err.max()))
            if os.environ.get("RIDGEFILL_PACKED_ISA"):  # capped under AVX-512: no bfloat16 tile, all float32
                y16 = torch.ops.ridgefill.packed_linear_bf16(x, w.data, w.scale, w.min, bits, group, w.n)
                assert torch.equal(y16, packed_linear(x, w)), (bits, group, dtype, with_min, rows)
        got = torch.ops.ridgefill.packed_dequantize_t(w.data, w.scale, w.min, bits, group, w.n)
        assert torch.equal(got, dequantize_t_reference(w)), (bits, group, dtype, with_min)
        got16 = torch.ops.ridgefill.packed_dequantize_t_bf16(w.data, w.scale, w.min, bits, group, w.n)
        assert torch.equal(got16, dequantize_t_reference(w).bfloat16()), (bits, group, dtype, with_min)
    print(repr(total))
""")


@needs_kernel
@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_every_instruction_set_matches_float64(isa):
    """The AVX2 and portable variants, which an AVX-512 machine never picks by itself: RIDGEFILL_PACKED_ISA
    caps the pick (read once, hence a fresh process), against float64 for every format and tile size."""
    if isa == "avx2" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU has no AVX2")
    sums = {}
    for cap in ("", isa):  # "": no cap, the variant this machine picks
        env = {k: v for k, v in os.environ.items() if k != "RIDGEFILL_PACKED_ISA"}
        if cap:
            env["RIDGEFILL_PACKED_ISA"] = cap
        run = subprocess.run([sys.executable, "-c", _ISA_CHECK], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        sums[cap] = float(run.stdout.strip())
    # the cap took effect: another summation order, so (almost surely) not the same float64 total
    picked = torch.backends.cpu.get_cpu_capability()
    if (isa, picked) in {("avx2", "AVX512"), ("portable", "AVX512"), ("portable", "AVX2")}:
        assert sums[isa] != sums[""]
