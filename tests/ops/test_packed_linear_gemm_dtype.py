"""model.gemm_dtype: packed weights' GEMM calls (BLAS_MIN_ROWS rows and up) and decode batches' whole
16-row blocks in bfloat16, against a float64 product of the bfloat16-rounded operands; calls under 16
rows untouched; the engine's refusals."""

from dataclasses import dataclass, field

import pytest
import torch

from ridgefill_runtime.config import EngineConfig
from ridgefill_runtime.errors import UnsupportedError
from ridgefill_runtime.ops import op_available
from ridgefill_runtime.ops import packed_linear as pl
from ridgefill_runtime.ops.packed_linear import BLAS_MIN_ROWS, dequantize_reference, pack, packed_linear

needs_kernel = pytest.mark.skipif(not op_available("packed_linear"), reason="compiled extension not built")


def _weight(n: int = 40, k: int = 96, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    scale = (torch.rand(n, k // 32, generator=g) * 0.02).to(torch.float16)
    mins = (torch.randn(n, k // 32, generator=g) * 0.05).to(torch.float16)
    return pack(q, scale, mins, 4, 32)


@needs_kernel
def test_bfloat16_gemm_is_the_product_of_the_rounded_operands():
    w32 = _weight()
    w16 = pl.replace(w32, gemm_dtype=torch.bfloat16)
    x = torch.randn(BLAS_MIN_ROWS + 3, 96, generator=torch.Generator().manual_seed(1))
    got = packed_linear(x, w16)
    # the operands rounded as the GEMM takes them, multiplied in float64
    want = x.bfloat16().double() @ dequantize_reference(w32).bfloat16().double().T  # [M, n]
    # float32 accumulation, then one rounding of the output to bfloat16 (8 bits)
    bound = 2.0**-8 * want.abs() + 1e-5 * (x.abs().double() @ dequantize_reference(w32).abs().double().T)
    assert got.dtype == torch.float32
    assert ((got.double() - want).abs() <= bound).all()
    exact = packed_linear(x, w32)
    assert not torch.equal(got, exact)  # it did round: the setting acts
    torch.testing.assert_close(got, exact, rtol=0.02, atol=0.02)


@needs_kernel
def test_calls_under_sixteen_rows_stay_float32():
    w32 = _weight()
    w16 = pl.replace(w32, gemm_dtype=torch.bfloat16)
    x = torch.randn(15, 96)
    assert torch.equal(packed_linear(x, w16), packed_linear(x, w32))  # batch-1 decode: the float32 kernel


_BF16_TILE = torch.cpu._is_avx512_bf16_supported()


@needs_kernel
@pytest.mark.parametrize(
    "bits,group,scale_dtype,with_min",
    [
        (4, 32, torch.float16, True),
        (8, 32, torch.float16, False),
        (8, 32, torch.float16, True),
        (4, 32, torch.float32, True),
        (8, 3, torch.float16, False),
    ],
)
@pytest.mark.parametrize("rows", [16, 35, BLAS_MIN_ROWS - 1])
def test_decode_batches_multiply_whole_sixteen_row_blocks_in_bfloat16(bits, group, scale_dtype, with_min, rows):
    """From 16 rows to BLAS_MIN_ROWS the packed kernel takes x's whole 16-row blocks in bfloat16
    (AVX512-BF16): the float64 product of the rounded operands, summed in float32. The rows past the
    last block, an odd group (a k pair would straddle two scales) and a CPU without AVX512-BF16
    stay float32, bit for bit."""
    g = torch.Generator().manual_seed(rows + bits)
    lo, hi = (0, 16) if bits == 4 else (-128, 128)
    q = torch.randint(lo, hi, (40, 96), generator=g)
    scale = (torch.rand(40, 96 // group, generator=g) * 0.02).to(scale_dtype)
    mins = (torch.randn(40, 96 // group, generator=g) * 0.05).to(scale_dtype) if with_min else None
    w32 = pack(q, scale, mins, bits, group)
    w16 = pl.replace(w32, gemm_dtype=torch.bfloat16)
    x = torch.randn(rows, 96, generator=g)
    got, exact = packed_linear(x, w16), packed_linear(x, w32)
    blocked = (rows // 16) * 16 if _BF16_TILE and group % 2 == 0 else 0
    assert torch.equal(got[blocked:], packed_linear(x[blocked:], w32))
    if blocked:
        wd = dequantize_reference(w32)
        want = x[:blocked].bfloat16().double() @ wd.bfloat16().double().T  # [blocked, n]
        bound = 1e-6 * (x[:blocked].abs().double() @ wd.abs().double().T) + 1e-7  # float32 sums only
        assert ((got[:blocked].double() - want).abs() <= bound).all()
        assert not torch.equal(got[:blocked], exact[:blocked])  # it did round


def test_slices_and_moves_keep_the_gemm_dtype_and_bad_ones_are_refused():
    w = pl.replace(_weight(), gemm_dtype=torch.bfloat16)
    assert w.rows(16, 40).gemm_dtype == torch.bfloat16 and w.rows(16, 40).n == 24
    assert w.to("cpu").gemm_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="gemm_dtype is float32 or bfloat16"):
        pl.replace(w, gemm_dtype=torch.float16)


def test_with_gemm_dtype_reaches_every_packed_weight_of_a_tree():
    @dataclass
    class Layer:
        qkv: object
        norm: torch.Tensor

    @dataclass
    class Tree:
        layers: list = field(default_factory=list)
        extra: dict = field(default_factory=dict)

    tree = Tree([Layer(_weight(), torch.ones(3)), Layer(_weight(seed=1), torch.ones(3))], {"head": _weight(seed=2)})
    assert pl.with_gemm_dtype(tree, torch.bfloat16) == 3
    assert [layer.qkv.gemm_dtype for layer in tree.layers] == [torch.bfloat16] * 2
    assert tree.extra["head"].gemm_dtype == torch.bfloat16
    assert torch.equal(tree.layers[0].norm, torch.ones(3))


def test_the_engine_refuses_bfloat16_gemms_where_they_would_not_act_or_pay(monkeypatch):
    from ridgefill_runtime.llm import build_engine

    monkeypatch.setattr("ridgefill_runtime.llm.bf16_gemm_native", lambda device: True)
    engine = build_engine(EngineConfig(gemm_dtype="bfloat16"))  # the embedded SmolLM2, packed
    weights = engine.model.weights
    assert {w.gemm_dtype for layer in weights.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)} == {
        torch.bfloat16
    }
    engine.close()
    with pytest.raises(UnsupportedError, match='acts on packed weights.*weights = "dequantized"'):
        build_engine(EngineConfig(gemm_dtype="bfloat16", weights="dequantized"))
    monkeypatch.setattr("ridgefill_runtime.llm.bf16_gemm_native", lambda device: False)
    with pytest.raises(UnsupportedError, match="needs a CPU with AVX512-BF16 or AMX"):
        build_engine(EngineConfig(gemm_dtype="bfloat16"))
    with pytest.raises(ValueError, match="gemm_dtype"):
        EngineConfig(gemm_dtype="float16")


@needs_kernel
@pytest.mark.parametrize("bits,group,with_min,n", [(4, 32, True, 40), (8, 32, False, 37), (4, 32, False, 16)])
def test_bfloat16_dequantize_rounds_the_float32_values_to_nearest_even(bits, group, with_min, n):
    g = torch.Generator().manual_seed(3)
    lo, hi = (0, 16) if bits == 4 else (-128, 128)
    q = torch.randint(lo, hi, (n, 128), generator=g)
    scale = (torch.rand(n, 128 // group, generator=g) * 0.02).to(torch.float16)
    mins = (torch.randn(n, 128 // group, generator=g) * 0.05).to(torch.float16) if with_min else None
    w = pack(q, scale, mins, bits, group)
    got = torch.ops.ridgefill.packed_dequantize_t_bf16(w.data, w.scale, w.min, w.bits, w.group, w.n)
    want = pl.dequantize_t_reference(w).to(torch.bfloat16)  # torch's own rounding, padding rows 0
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))
