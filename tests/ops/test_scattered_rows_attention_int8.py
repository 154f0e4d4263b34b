"""The int8 K/V cache (cache.kv_dtype = "int8"): its quantization (ridgefill_runtime/cache/int8_kv.py) against a
float64 naive one, and scattered_rows_attention over int8 slabs (the CPU kernel's
ridgefill::scattered_rows_attention_int8, dequantizing in registers) against the pure-torch reference and an
independent float64 computation on the dequantized K/V.

Tolerances: a stored element is within scale / 2 of the written one (round to nearest), plus float32's rounding
of x / scale (a few ulps of the quotient, 2^-23 * 127 relative to the scale at most). Attention outputs within the
float32 bound of test_scattered_rows_attention_cpu.py (1e-5), since the kernel and the reference both attend to
float(q) * scale, the same float32 numbers.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from test_scattered_rows_attention_cpu import D, SPLIT_ENV, assert_mass_close, assert_out_close, mixed_batch, naive_f64

from ridgefill_runtime import ops
from ridgefill_runtime.cache import int8_kv
from ridgefill_runtime.ops import scattered_rows_attention, scattered_rows_attention_reference


def int8_compiled() -> bool:
    return bool(sys.modules["ridgefill_runtime.ops.scattered_rows_attention"]._INT8_KERNEL)


def naive_quantize_f64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group of 32 values of a row, one value at a time in float64: s = max|x_g| / 127, q = nearest integer
    to x / s (0 where s = 0). Returns q [N, Hkv, D] and s [N, Hkv, ceil(D / 32)]."""
    x = x.double()
    N, H, D = x.shape
    G = -(-D // 32)
    q, s = torch.zeros_like(x), torch.zeros(N, H, G, dtype=torch.float64)
    for n in range(N):
        for h in range(H):
            for g in range(G):
                vals = x[n, h, 32 * g : 32 * g + 32]
                s[n, h, g] = max(abs(float(a)) for a in vals) / 127
                if s[n, h, g] > 0:
                    q[n, h, 32 * g : 32 * g + 32] = (vals / s[n, h, g]).round()
    return q, s


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 300.0])
def test_quantize_is_within_half_a_step_of_float64(magnitude):
    g = torch.Generator().manual_seed(0)
    x = magnitude * torch.randn(50, 3, 40, generator=g)
    x[4, 1] = 0.0  # an all-zero row: scale 0, zeros back (not NaN)
    x[7, 0, 5] = -magnitude * 20  # one outlier sets its group's scale, not its row's
    q, s = int8_kv.quantize(x)  # 40 values: a group of 32 and one of 8
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (50, 3, 2)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    q64, s64 = naive_quantize_f64(x)
    torch.testing.assert_close(s.double(), s64, rtol=2**-23, atol=0)
    # A quotient within a few ulps of .5 may round either way; every other element is the float64 integer.
    assert float((q.double() - q64).abs().max()) <= 1
    assert int((q.double() != q64).sum()) <= 2
    back = int8_kv.dequantize(q, s)  # [50, 3, 40] float32
    err = (back.double() - x.double()).abs()
    per_value = torch.cat([s64[..., :1].expand(-1, -1, 32), s64[..., 1:].expand(-1, -1, 8)], -1)  # [50, 3, 40]
    bound = per_value / 2 * (1 + 1e-5)  # half a step, plus float32's rounding of x / s and q * s
    assert bool((err <= bound).all()), float((err - bound).max())
    assert torch.equal(back[4, 1], torch.zeros(40))
    assert float(err.max()) > 0  # it does round
    assert float(s[7, 0, 0]) == pytest.approx(magnitude * 20 / 127) and float(s[7, 0, 1]) < float(s[7, 0, 0]) / 4


def int8_slabs(k_slab, v_slab):
    """float32 slabs (NaN in unowned slots) -> int8 slabs and their scales; an unowned slot keeps a NaN scale, so
    a wrong read still shows."""
    kq, ks = int8_kv.quantize(k_slab)
    vq, vs = int8_kv.quantize(v_slab)
    return kq, vq, ks, vs


@pytest.mark.parametrize("heads,kv_heads", [(3, 3), (8, 2)], ids=["g1", "g4"])
@pytest.mark.parametrize("window", [0, 300])
def test_int8_slabs_match_the_reference_and_f64(heads, kv_heads, window, monkeypatch):
    q, q_seq, q_pos, k_slab, v_slab, tables, ctx = mixed_batch(heads, kv_heads, 16, torch.float32, seed=3)
    kq, vq, ks, vs = int8_slabs(k_slab, v_slab)
    scale = D**-0.5
    args = (q, q_seq, q_pos, kq, vq, tables, ctx, 16, scale, True, window)
    out, mass = scattered_rows_attention(*args, k_scale=ks, v_scale=vs)
    ref_out, ref_mass = scattered_rows_attention_reference(*args, k_scale=ks, v_scale=vs)
    k_deq, v_deq = int8_kv.dequantize(kq, ks), int8_kv.dequantize(vq, vs)  # NaN where unowned
    exact_out, exact_mass = naive_f64(q, q_seq, q_pos, k_deq, v_deq, tables, 16, scale, window)
    assert_out_close(out, exact_out, torch.float32)
    assert_out_close(ref_out, exact_out, torch.float32)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    if window == 0:  # (naive_f64's mass covers every key of the row; with a window the reference's is the check)
        assert_mass_close(mass, exact_mass)
    torch.testing.assert_close(mass, ref_mass, rtol=1e-4, atol=1e-5)
    # Quantizing changed the answer (the float32 slabs give another one), by far less than the values' size.
    float_out, _ = scattered_rows_attention(q, q_seq, q_pos, k_slab, v_slab, tables, ctx, 16, scale, window=window)
    diff = float((out - float_out).abs().max())
    assert 1e-4 < diff < 0.05, diff
    monkeypatch.setenv(SPLIT_ENV, "1")
    out_split, _ = scattered_rows_attention(*args[:9], window=window, k_scale=ks, v_scale=vs)
    assert_out_close(out_split, exact_out, torch.float32)


def test_odd_head_dim_and_half_queries():
    """A head dim that is not a multiple of the vector width (the scalar tails), and bfloat16 queries: widened
    to float32 for the int8 path, the output rounded back."""
    g = torch.Generator().manual_seed(5)
    k = torch.randn(40, 2, 21, generator=g)
    v = torch.randn(40, 2, 21, generator=g)
    kq, vq, ks, vs = int8_slabs(k, v)
    tables = torch.arange(10, dtype=torch.int32).view(2, 5)
    ctx = torch.tensor([20, 13], dtype=torch.int32)
    q = torch.randn(4, 6, 21, generator=g)
    q_seq = torch.tensor([0, 0, 1, 1], dtype=torch.int32)
    q_pos = torch.tensor([19, 3, 12, 0])
    args = (q_seq, q_pos, kq, vq, tables, ctx, 4, 0.2)
    out, _ = scattered_rows_attention(q, *args, k_scale=ks, v_scale=vs)
    exact, _ = naive_f64(q, q_seq, q_pos, int8_kv.dequantize(kq, ks), int8_kv.dequantize(vq, vs), tables, 4, 0.2)
    assert_out_close(out, exact, torch.float32)
    out_bf, _ = scattered_rows_attention(q.bfloat16(), *args, k_scale=ks, v_scale=vs)
    exact_bf, _ = naive_f64(
        q.bfloat16().float(), q_seq, q_pos, int8_kv.dequantize(kq, ks), int8_kv.dequantize(vq, vs), tables, 4, 0.2
    )
    assert_out_close(out_bf, exact_bf, torch.bfloat16)


def test_int8_needs_its_scales_and_float32_queries():
    q, q_seq, q_pos, k_slab, v_slab, tables, ctx = mixed_batch(4, 2, 16, torch.float32)
    kq, vq, ks, vs = int8_slabs(k_slab, v_slab)
    with pytest.raises(TypeError, match="k_scale/v_scale"):
        scattered_rows_attention(q, q_seq, q_pos, kq, vq, tables, ctx, 16, 0.1)
    with pytest.raises(ValueError, match=r"k_scale/v_scale must be .*\[S, Hkv, G\]"):
        scattered_rows_attention(q, q_seq, q_pos, kq, vq, tables, ctx, 16, 0.1, k_scale=ks[:-1], v_scale=vs)
    with pytest.raises(TypeError, match="int8 slabs only"):
        scattered_rows_attention(q, q_seq, q_pos, k_slab, v_slab, tables, ctx, 16, 0.1, k_scale=ks, v_scale=vs)
    with pytest.raises(TypeError, match="k_scale/v_scale"):
        scattered_rows_attention_reference(q, q_seq, q_pos, kq, vq, tables, ctx, 16, 0.1)


def test_int8_kernel_is_the_cpu_path():
    """Every build of the extension has the int8 op's CPU kernel (csrc/bindings.cpp defines it beside the float
    one), and the wrapper calls it; its own checks name it."""
    if os.environ.get("RIDGEFILL_REQUIRE_EXTENSION") == "1":
        assert ops.extension_loaded()
    assert int8_compiled() == ops.extension_loaded()
    if not int8_compiled():
        return
    q, q_seq, q_pos, k_slab, v_slab, tables, ctx = mixed_batch(9, 3, 16, torch.float32, seed=9)
    kq, vq, ks, vs = int8_slabs(k_slab, v_slab)
    direct = torch.ops.ridgefill.scattered_rows_attention_int8(
        q, q_seq, q_pos, kq, vq, ks, vs, tables, ctx, 16, D**-0.5, True
    )
    wrapped = scattered_rows_attention(q, q_seq, q_pos, kq, vq, tables, ctx, 16, D**-0.5, True, k_scale=ks, v_scale=vs)
    assert torch.equal(direct[0], wrapped[0]) and torch.equal(direct[1], wrapped[1])
    with pytest.raises(TypeError, match="scattered_rows_attention_int8: needs float32 q over int8"):
        torch.ops.ridgefill.scattered_rows_attention_int8(
            q, q_seq, q_pos, k_slab, v_slab, ks, vs, tables, ctx, 16, 0.1, False
        )
    with pytest.raises(TypeError, match="k_scale/v_scale must be float32"):
        torch.ops.ridgefill.scattered_rows_attention_int8(
            q, q_seq, q_pos, kq, vq, ks.double(), vs, tables, ctx, 16, 0.1, False
        )


def test_compiled_write_stores_the_bytes_quantize_makes(monkeypatch):
    """ridgefill::int8_kv_write (csrc/cpu/int8_kv_cpu.cpp, the pool's write) against int8_kv.quantize: the same
    int8 values and scales, bit for bit, at the given slots only (ties at .5 included: both round half to even)."""
    assert int8_kv._compiled_write() == ops.extension_loaded()
    g = torch.Generator().manual_seed(2)
    k = torch.randn(7, 3, 40, generator=g) * torch.tensor([1e-3, 1.0, 50.0])[None, :, None]
    v = torch.randn(7, 3, 40, generator=g)
    k[2, 1] = 0.0  # scale 0
    v[3, 0, :2] = torch.tensor([127.0, 0.5])  # scale 1: 0.5 is a tie, to even (0)
    v[4, 2, :2] = torch.tensor([-127.0, 2.5])  # and 2.5 to 2
    at = torch.tensor([9, 0, 4, 13, 2, 7, 11])

    def slabs():
        return (
            torch.zeros(16, 3, 40, dtype=torch.int8),
            torch.zeros(16, 3, 40, dtype=torch.int8),
            torch.zeros(16, 3, 2),
            torch.zeros(16, 3, 2),
        )

    got = slabs()
    int8_kv.write(*got, at, k, v)
    monkeypatch.setattr(int8_kv, "_WRITE_OP", False)  # the torch fallback
    want = slabs()
    int8_kv.write(*want, at, k, v)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert int(got[1][13, 0, 1]) == 0 and int(got[1][2, 2, 1]) == 2
    assert int((got[0].abs().sum((1, 2)) > 0).sum()) == 7  # only the written slots
    kq, ks = int8_kv.quantize(k)
    assert torch.equal(got[0][at], kq) and torch.equal(got[2][at], ks)
    if ops.extension_loaded():
        with pytest.raises(IndexError, match="int8_kv_write: slot 16 outside"):
            torch.ops.ridgefill.int8_kv_write(*got, torch.tensor([16]), k[:1], v[:1])
