"""The CUDA packed-weight kernels (csrc/packed_linear.cu) against the float64 reference and the CPU
path: every format the loader produces, n not a multiple of 16, decode and prefill row counts,
packed_dequantize_t bit for bit, and a call inside a captured CUDA graph. The routing test at the
end runs without a GPU."""

import os

import pytest
import torch

from ridgefill_runtime.ops import extension_loaded
from ridgefill_runtime.ops.packed_linear import (
    CUDA_BLAS_MIN_ROWS,
    compiled_for,
    dequantize_reference,
    dequantize_t_reference,
    pack,
    packed_linear,
    packed_linear_reference,
    weight_slice,
)

from test_packed_linear import _random  # noqa: E402  (pytest puts tests/ops on sys.path)

REQUIRED = os.environ.get("RIDGEFILL_REQUIRE_EXTENSION") == "1"
CUDA = torch.device("cuda")
K = 768  # a multiple of every group below

# (bits, group, scale dtype, with a min): Q4_1, Q4_0, Q8_0, Q6_K (group 16, float32), Q4_K (float32
# scale and min), groups of 256, and odd groups (6, 2: not a multiple of 4 chunks: the kernel's
# one-chunk-per-run variant)
FORMATS = [
    (4, 32, torch.float16, True),
    (4, 32, torch.float16, False),
    (8, 32, torch.float16, False),
    (8, 16, torch.float32, False),
    (4, 32, torch.float32, True),
    (4, 256, torch.float16, True),
    (8, 256, torch.float32, True),
    (4, 6, torch.float16, True),
    (8, 2, torch.float32, False),
]
FORMAT_IDS = [f"q{b}-g{g}-{str(d)[6:]}{'-min' if m else ''}" for b, g, d, m in FORMATS]
ROWS = [1, 2, 5, 8, 16, 33, 300]


def _weight(n: int, k: int, bits: int, group: int, dtype, with_min: bool, seed: int = 0):
    q, scale, mins = _random(n, k, bits, group, dtype, with_min, seed)  # the CPU tests' draw
    return pack(q, scale, mins, bits, group)


def _op(x, w):
    return torch.ops.ridgefill.packed_linear(x, w.data, w.scale, w.min, w.bits, w.group, w.n)


def _check(got: torch.Tensor, x: torch.Tensor, w) -> None:
    """float32 sums of K products against float64: error ~ sqrt(K) ulps of the terms' magnitude."""
    x, got = x.cpu(), got.cpu()
    want = packed_linear_reference(x, w)
    bound = 1e-6 * (x.abs().double() @ dequantize_reference(w).abs().double().T) + 1e-7
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), f"max |err| {float(err.max()):.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("bits,group,dtype,with_min", FORMATS, ids=FORMAT_IDS)
def test_kernel_matches_float64(bits, group, dtype, with_min):
    """The op itself (no routing) at every row count: 1-2 rows take their own tile sizes, the rest
    tiles of 4 with a partial last tile."""
    w = _weight(45, K, bits, group, dtype, with_min)  # 45: a partial last panel
    wc = w.to(CUDA)
    for rows in ROWS:
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
        got = _op(x.to(CUDA), wc)
        assert got.shape == (rows, 45) and got.dtype == torch.float32 and got.is_cuda
        _check(got, x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("bits,dtype,with_min", [(4, torch.float16, True), (8, torch.float32, False)])
def test_kernel_splits_long_rows_over_teams(bits, dtype, with_min):
    """K = 4096 over few panels: the host splits each panel's k range over 2-4 teams, whose sums
    meet in shared memory."""
    w = _weight(40, 4096, bits, 32, dtype, with_min, seed=3)
    wc = w.to(CUDA)
    for rows in (1, 3, 16):
        x = torch.randn(rows, 4096, generator=torch.Generator().manual_seed(rows))
        _check(_op(x.to(CUDA), wc), x, w)


@pytest.mark.gpu
def test_kernel_covers_more_panel_blocks_than_the_grid():
    """More than 65535 blocks of panels: the kernel loops over the ones past gridDim.y."""
    n = (65535 * 4 + 5) * 16 - 3
    w = _weight(n, 16, 4, 16, torch.float16, True, seed=5)
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(2))
    _check(_op(x.to(CUDA), w.to(CUDA)), x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("bits,group,dtype,with_min", FORMATS, ids=FORMAT_IDS)
def test_dequantize_t_is_bit_identical(bits, group, dtype, with_min):
    """W.T as the reference computes it (q * scale rounded, then + min rounded), padding rows 0 --
    also for a slice whose last panel holds real rows past its n."""
    w = _weight(45, K, bits, group, dtype, with_min)
    for part in (w, weight_slice(w, 16, 40)):
        got = torch.ops.ridgefill.packed_dequantize_t(
            *(t.to(CUDA) for t in (part.data, part.scale, part.min)), part.bits, part.group, part.n
        )
        assert got.shape == (K, part.data.shape[0] * 16) and got.dtype == torch.float32
        assert torch.equal(got.cpu(), dequantize_t_reference(part))


@pytest.mark.gpu
def test_wrapper_on_cuda_equals_the_cpu_path():
    """packed_linear on CUDA (kernel below CUDA_BLAS_MIN_ROWS, dequantize + cuBLAS from there) against
    the CPU path: the same weights, so they differ by float32 summation order only. Leading dims,
    bias and a bfloat16 input as the models call it."""
    assert compiled_for(CUDA)
    w = _weight(45, K, 4, 32, torch.float16, True, seed=1)
    wc = w.to(CUDA)
    bias = torch.randn(45)
    for rows in (1, 5, CUDA_BLAS_MIN_ROWS - 1, CUDA_BLAS_MIN_ROWS, 300):
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
        got, cpu = packed_linear(x.to(CUDA), wc), packed_linear(x, w)
        _check(got, x, w)
        _check(cpu, x, w)
        bound = 2e-6 * (x.abs().double() @ dequantize_reference(w).abs().double().T) + 2e-7
        assert bool(((got.cpu().double() - cpu.double()).abs() <= bound).all())
    x3 = torch.randn(2, 3, K)
    got = packed_linear(x3.to(CUDA), wc, bias.to(CUDA))
    assert got.shape == (2, 3, 45)
    torch.testing.assert_close(got.cpu(), packed_linear(x3, w, bias), rtol=1e-5, atol=1e-5)
    got_bf16 = packed_linear(x3.to(CUDA).bfloat16(), wc)
    assert got_bf16.dtype == torch.bfloat16 and got_bf16.shape == (2, 3, 45)


@pytest.mark.gpu
def test_kernel_replays_in_a_cuda_graph():
    """Captured once, replayed after x changed in place: no host synchronisation or allocation of
    its own in the call (the output comes from the graph's pool)."""
    w = _weight(45, K, 4, 32, torch.float16, True, seed=2).to(CUDA)
    x = torch.randn(4, K, device=CUDA)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graphs asks
        packed_linear(x, w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = packed_linear(x, w)
    for seed in (11, 12):
        x.copy_(torch.randn(4, K, generator=torch.Generator().manual_seed(seed)).to(CUDA))
        graph.replay()
        torch.cuda.synchronize()
        _check(y, x, w.to("cpu"))


@pytest.mark.gpu
def test_kernel_refuses_bad_arguments():
    w = _weight(16, 64, 4, 32, torch.float16, False).to(CUDA)
    with pytest.raises(RuntimeError, match=r"x must be float32 \[M, 64\]"):
        _op(torch.randn(2, 32, device=CUDA), w)
    with pytest.raises(RuntimeError, match="scale must be float16 or float32"):
        torch.ops.ridgefill.packed_linear(torch.randn(2, 64, device=CUDA), w.data, w.scale.bfloat16(), w.min, 4, 32, 16)
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        data = torch.empty(w.data.numel() + 1, dtype=torch.uint8, device=CUDA)[1:].view(w.data.shape)
        torch.ops.ridgefill.packed_linear(torch.randn(2, 64, device=CUDA), data, w.scale, w.min, 4, 32, 16)


def test_cuda_routing_follows_the_build():
    """packed_linear sends CUDA tensors to the kernel exactly when this _C registers both packed ops
    for CUDA (a ROCm build without them or a CPU-only build keeps the dequantizing fallback, and the
    engine refuses weights = "packed" there); a required CUDA build must have them."""

    def has(op: str) -> bool:
        return extension_loaded() and torch._C._dispatch_has_kernel_for_dispatch_key(f"ridgefill::{op}", "CUDA")

    assert compiled_for(CUDA) == (has("packed_linear") and has("packed_dequantize_t"))
    assert not compiled_for(torch.device("meta"))
    if REQUIRED and has("rms_norm"):  # the extension was built with its CUDA sources
        assert compiled_for(CUDA), "a CUDA build of _C without csrc/packed_linear.cu's kernels"
