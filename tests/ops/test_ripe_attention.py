"""ripe_attention against a float64 loop that picks each key's plane by the rule of the op's docstring
(block / ring / deep per query position t and key position j); every entry the rule never reads is NaN,
so reading the wrong plane or slot shows up as NaN or as a mismatch."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from ridgefill_runtime import ops
from ridgefill_runtime.ops import ripe_attention, ripe_attention_reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # fp32: sum noise; else unit roundoff
DTYPES = list(TOL)
NAN = float("nan")


def make_inputs(
    cache_lens,
    block_len,
    heads,
    kv_heads,
    head_dim,
    window,
    capacity,
    dtype=torch.float32,
    device="cpu",
    seed=0,
    poison=True,
    deep_len=None,
):
    """(q, block_k, block_v, deep_k, deep_v, ring_k, ring_v, cache_lens) as the op's layout describes; with
    `poison`, NaN in every deep row and ring slot the window rule never reads for this block."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(cache_lens)
    deep_len = deep_len if deep_len is not None else max(cache_lens) + 3  # spare rows past every t0
    randn = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q = randn(batch, block_len, heads, head_dim)
    block_k, block_v = randn(batch, block_len, kv_heads, head_dim), randn(batch, block_len, kv_heads, head_dim)
    deep_k, deep_v = randn(batch, deep_len, kv_heads, head_dim), randn(batch, deep_len, kv_heads, head_dim)
    ring_k, ring_v = randn(batch, capacity, kv_heads, head_dim), randn(batch, capacity, kv_heads, head_dim)
    if poison:
        for b, t0 in enumerate(cache_lens):
            # Query t0 + a reads the ring for t0 + a - W <= j < t0 and deep for j < t0 + a - W.
            deep_read = set(range(min(t0, max(0, t0 + block_len - 1 - window)))) if block_len else set()
            ring_read = {j % capacity for j in range(max(0, t0 - window), t0)} if window and block_len else set()
            for j in range(deep_len):
                if j not in deep_read:
                    deep_k[b, j] = deep_v[b, j] = NAN
            for c in range(capacity):
                if c not in ring_read:
                    ring_k[b, c] = ring_v[b, c] = NAN
    lens = torch.tensor(cache_lens, dtype=torch.int32)
    cast = lambda t: t.to(dtype).to(device)  # noqa: E731
    return (
        cast(q),
        cast(block_k),
        cast(block_v),
        cast(deep_k),
        cast(deep_v),
        cast(ring_k),
        cast(ring_v),
        lens.to(device),
    )


def naive_f64(q, block_k, block_v, deep_k, deep_v, ring_k, ring_v, cache_lens, window, scale):
    """Explicit loops over sequences, queries, heads and keys, in Python floats."""
    batch, block_len, heads, head_dim = q.shape
    group = heads // block_k.shape[2]
    capacity = ring_k.shape[1]
    out = torch.zeros(batch, block_len, heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        t0 = int(cache_lens[b])
        for a in range(block_len):
            t = t0 + a
            for h in range(heads):
                kvh = h // group
                keys, vals = [], []
                for j in range(t + 1):
                    if j >= t0:
                        kk, vv = block_k[b, j - t0, kvh], block_v[b, j - t0, kvh]
                    elif t - j <= window:
                        kk, vv = ring_k[b, j % capacity, kvh], ring_v[b, j % capacity, kvh]
                    else:
                        kk, vv = deep_k[b, j, kvh], deep_v[b, j, kvh]
                    keys.append(kk.double().tolist())
                    vals.append(vv.double().tolist())
                qv = q[b, a, h].double().tolist()
                s = [scale * math.fsum(x * y for x, y in zip(qv, kk)) for kk in keys]
                top = max(s)
                e = [math.exp(x - top) for x in s]
                z = math.fsum(e)
                for d in range(head_dim):
                    out[b, a, h, d] = math.fsum(ej * vv[d] for ej, vv in zip(e, vals)) / z
    return out


# (cache lens, Tq, W, C): B = 2 with different t0 (t0 = 0, t0 < W, t0 wrapping the ring several times);
# C = W and C > W; with W = 0 the ring is never read (C = 1 and C = 4).
LENS = [[0, 13], [2, 29]]
CASES = [
    (lens, tq, w, c)
    for lens, tq, w in itertools.product(LENS, [1, 5], [0, 3, 8])
    for c in ([1, 4] if w == 0 else [w, w + 3])
]


def _case_id(case):
    lens, tq, w, c = case
    return f"t0{lens[0]}+{lens[1]}-Tq{tq}-W{w}-C{c}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_reference_matches_naive_f64(case):
    lens, block_len, window, capacity = case
    args = make_inputs(lens, block_len, 4, 2, 8, window, capacity, seed=block_len + 7 * window + capacity)
    scale = 8**-0.5
    out = ripe_attention_reference(*args, window, scale)
    assert out.dtype == torch.float32 and out.shape == args[0].shape and not out.isnan().any()
    torch.testing.assert_close(out.double(), naive_f64(*args, window, scale), rtol=1e-5, atol=1e-5)
    # The public wrapper (CPU tensors: the reference) and, when compiled, the op's CPU kernel agree.
    torch.testing.assert_close(ripe_attention(*args, window, scale), out, rtol=0, atol=0)
    if ops.op_available("ripe_attention"):
        torch.testing.assert_close(torch.ops.ridgefill.ripe_attention(*args, window, scale), out, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 8), (6, 2, 5), (3, 3, 16)])
def test_reference_low_precision_and_head_layouts(dtype, heads, kv_heads, head_dim):
    # fp32 math on the rounded inputs, one rounding of the output; MHA, group 3, odd D.
    args = make_inputs([9, 4], 5, heads, kv_heads, head_dim, 3, 5, dtype, seed=heads * head_dim)
    out = ripe_attention_reference(*args, 3, 0.3)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.double(), naive_f64(*args, 3, 0.3), rtol=TOL[dtype], atol=TOL[dtype])


def _plain_causal(q, keys, values, t0, scale):
    """Causal SDPA of one sequence's block [Tq, H, D] over keys/values [t0 + Tq, Hkv, D] (GQA expanded)."""
    group = q.shape[1] // keys.shape[1]
    block_len = q.shape[0]
    mask = torch.arange(t0 + block_len)[None, :] <= (t0 + torch.arange(block_len))[:, None]  # [Tq, L]
    kh = keys.transpose(0, 1).repeat_interleave(group, 0)  # [H, L, D]
    vh = values.transpose(0, 1).repeat_interleave(group, 0)
    return F.scaled_dot_product_attention(q.transpose(0, 1), kh, vh, attn_mask=mask, scale=scale).transpose(0, 1)


def test_window_rule_decides_the_plane():
    # Ring and deep hold different (random) data for the same positions, so the window must change the output.
    lens, block_len, capacity = [6, 17], 5, 8
    q, bk, bv, dk, dv, rk, rv, cl = make_inputs(lens, block_len, 4, 2, 8, 8, capacity, poison=False, seed=11)
    scale = 0.35
    outs = {w: ripe_attention(q, bk, bv, dk, dv, rk, rv, cl, w, scale) for w in (0, 1, 3, 8)}
    for w1, w2 in itertools.combinations(outs, 2):
        assert (outs[w1] - outs[w2]).abs().max() > 1e-3, (w1, w2)
    for b, t0 in enumerate(lens):
        # W = 0: plain causal attention over deep rows 0..t0-1 then the block.
        keys, vals = torch.cat([dk[b, :t0], bk[b]]), torch.cat([dv[b, :t0], bv[b]])
        torch.testing.assert_close(outs[0][b], _plain_causal(q[b], keys, vals, t0, scale), rtol=1e-5, atol=1e-5)
    # W >= t0 + Tq - 1 and C > every cached position (no slot reuse): every cached key comes from the ring.
    t0 = 6
    wq, wbk, wbv, wdk, wdv, wrk, wrv, wcl = make_inputs([t0], block_len, 4, 2, 8, 10, 12, poison=False, seed=12)
    wide = ripe_attention(wq, wbk, wbv, wdk, wdv, wrk, wrv, wcl, 10, scale)
    keys, vals = torch.cat([wrk[0, :t0], wbk[0]]), torch.cat([wrv[0, :t0], wbv[0]])
    torch.testing.assert_close(wide[0], _plain_causal(wq[0], keys, vals, t0, scale), rtol=1e-5, atol=1e-5)
    # The rule is per query: with W = 3, query a reads position j from the ring iff t0 + a - j <= 3.
    # Changing one ring slot changes exactly the queries that read it.
    t0 = lens[0]
    j = t0 - 2  # read from the ring by queries a <= 1 only
    rk2 = rk.clone()
    rk2[0, j % capacity] += 1.0
    diff = (ripe_attention(q, bk, bv, dk, dv, rk2, rv, cl, 3, scale) - outs[3]).abs().amax(dim=(2, 3))  # [B, Tq]
    assert (diff[0, :2] > 1e-4).all() and (diff[0, 2:] < 1e-6).all() and (diff[1] < 1e-6).all(), diff


def test_ring_equal_to_deep_makes_window_irrelevant():
    # If the ring holds the same plane as deep for the recent positions, every W reads the same values.
    lens, block_len, window = [7, 12], 5, 8
    q, bk, bv, dk, dv, rk, rv, cl = make_inputs(lens, block_len, 4, 2, 8, window, window, poison=False, seed=3)
    for b, t0 in enumerate(lens):
        for j in range(max(0, t0 - window), t0):
            rk[b, j % window], rv[b, j % window] = dk[b, j], dv[b, j]
    ref = ripe_attention(q, bk, bv, dk, dv, rk, rv, cl, 0, 0.4)
    for w in (1, 3, 8):
        torch.testing.assert_close(ripe_attention(q, bk, bv, dk, dv, rk, rv, cl, w, 0.4), ref, rtol=1e-6, atol=1e-6)


def test_empty_block_and_exact_deep_length():
    args = make_inputs([4, 0], 0, 2, 1, 4, 3, 3)
    assert ripe_attention(*args, 3, 1.0).shape == (2, 0, 2, 4)
    # T == max t0 (no spare deep rows), and T == 0 when nothing is cached.
    args = make_inputs([5, 2], 2, 2, 1, 4, 3, 3, deep_len=5)
    torch.testing.assert_close(ripe_attention(*args, 3, 0.5).double(), naive_f64(*args, 3, 0.5), rtol=1e-5, atol=1e-5)
    args = make_inputs([0, 0], 3, 2, 1, 4, 0, 1, deep_len=0)
    torch.testing.assert_close(ripe_attention(*args, 0, 0.5).double(), naive_f64(*args, 0, 0.5), rtol=1e-5, atol=1e-5)


def test_bad_arguments():
    q, bk, bv, dk, dv, rk, rv, cl = make_inputs([6, 3], 2, 4, 2, 8, 3, 3, poison=False)
    call = lambda *a, window=3: ripe_attention(*a, window, 0.5)  # noqa: E731
    with pytest.raises(ValueError, match=r"ring capacity C=3 < window W=4"):
        call(q, bk, bv, dk, dv, rk, rv, cl, window=4)
    with pytest.raises(TypeError, match=r"cache_lens must be int32.*int64"):
        call(q, bk, bv, dk, dv, rk, rv, cl.long())
    q6 = torch.randn(2, 2, 6, 8)
    b3 = torch.randn(2, 2, 3, 8)
    with pytest.raises(ValueError, match=r"H=6 must be a multiple of Hkv=4"):
        call(q6, *(torch.randn(*t.shape[:2], 4, 8) for t in (bk, bv, dk, dv, rk, rv)), cl)
    with pytest.raises(ValueError, match=r"\[Hkv, D\]"):
        call(q, b3, b3, dk, dv, rk, rv, cl)
    with pytest.raises(TypeError, match=r"share q's dtype.*ring_k"):
        call(q, bk, bv, dk, dv, rk.half(), rv, cl)
    with pytest.raises(TypeError, match=r"q must be float32, bfloat16 or float16"):
        call(q.double(), bk.double(), bv.double(), dk.double(), dv.double(), rk.double(), rv.double(), cl)
    with pytest.raises(ValueError, match=r"batch sizes differ"):
        call(q, bk, bv, dk[:1], dv[:1], rk, rv, cl)
    with pytest.raises(ValueError, match=r"block_k/v hold 1 tokens, q has Tq=2"):
        call(q, bk[:, :1], bv[:, :1], dk, dv, rk, rv, cl)
    with pytest.raises(ValueError, match=r"deep_k .* and deep_v .* differ in shape"):
        call(q, bk, bv, dk, dv[:, :-1], rk, rv, cl)
    with pytest.raises(ValueError, match=r"head dim D must be in \[1, 256\]"):
        big = lambda t: torch.randn(*t.shape[:3], 257)  # noqa: E731
        call(big(q), big(bk), big(bv), big(dk), big(dv), big(rk), big(rv), cl)
    with pytest.raises(ValueError, match=r"window W must be >= 0"):
        call(q, bk, bv, dk, dv, rk, rv, cl, window=-1)
    with pytest.raises(ValueError, match=r"at least one slot"):
        call(q, bk, bv, dk, dv, rk[:, :0], rv[:, :0], cl, window=0)
    with pytest.raises(ValueError, match=r"sequence 1 has t0=10 cached positions; deep_k/v hold T=9"):
        call(q, bk, bv, dk, dv, rk, rv, torch.tensor([6, 10], dtype=torch.int32))
    # W == 0: the ring is never read, so any C >= 1 is fine, C < W only matters when W > 0.
    call(q, bk, bv, dk, dv, rk[:, :1], rv[:, :1], cl, window=0)


def test_opcheck_on_cpu():
    """Schema, fake and CPU kernel agree (torch.library.opcheck, no GPU needed); the fake rejects bad args."""
    if not ops.op_available("ripe_attention"):
        assert not hasattr(torch.ops.ridgefill, "ripe_attention")
        return
    op = torch.ops.ridgefill.ripe_attention.default
    for lens, block_len, window, capacity in [([4, 7], 2, 3, 3), ([0, 9], 5, 0, 1), ([2, 11], 1, 8, 10)]:
        args = make_inputs(lens, block_len, 4, 2, 8, window, capacity, poison=False, seed=window)
        torch.library.opcheck(op, (*args, window, 0.3))
    args = make_inputs([4, 7], 2, 4, 2, 8, 3, 3, poison=False)
    with pytest.raises(ValueError, match="ring capacity"):
        torch.ops.ridgefill.ripe_attention(*[a.to("meta") for a in args], 4, 0.3)


# ---------------------------------------------------------------------------
# CUDA kernel (skipped, visibly, without a CUDA device: tests/conftest.py).

GPU_CASES = [(lens, tq, w, c, 4, 2, 8) for lens, tq, w, c in CASES] + [
    # (cache lens, Tq, W, C, H, Hkv, D)
    ([0, 37], 5, 3, 3, 4, 2, 64),
    ([2, 300], 1, 8, 8, 4, 2, 96),
    ([5, 129], 5, 8, 11, 4, 2, 128),
    ([1000, 37, 4095, 1], 1, 64, 64, 32, 8, 128),  # decode batch, Huginn-like W = 64
    ([2000, 511], 5, 4, 4, 16, 2, 64),  # γ = 4 verification, W = γ
    ([300, 3], 5, 0, 1, 8, 1, 256),  # W = 0 (full / deepest-plane cache), D 256
    ([77, 5], 3, 16, 20, 20, 1, 96),  # group 20 > MAXG
    ([40, 9], 2, 6, 6, 6, 6, 33),  # MHA, odd D
]


def _gpu_id(case):
    lens, tq, w, c, h, hkv, d = case
    return f"B{len(lens)}-t0{max(lens)}-Tq{tq}-W{w}-C{c}-H{h}-Hkv{hkv}-D{d}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", GPU_CASES, ids=_gpu_id)
def test_kernel_matches_reference(case, dtype):
    assert ops.op_available("ripe_attention"), ops.extension_error()
    lens, block_len, window, capacity, heads, kv_heads, head_dim = case
    for seed in range(2):
        args = make_inputs(
            lens, block_len, heads, kv_heads, head_dim, window, capacity, dtype, device="cuda", seed=seed
        )
        scale = head_dim**-0.5
        torch.full(args[0].shape, NAN, dtype=dtype, device="cuda")  # poison the allocator
        out = torch.ops.ridgefill.ripe_attention(*args, window, scale)
        assert out.dtype == dtype and out.shape == args[0].shape and not out.isnan().any()
        # The reference on the same (rounded) inputs: fp32 math, one rounding to dtype, like the kernel.
        ref = ripe_attention_reference(*[a.cpu() for a in args], window, scale)
        tol = TOL[dtype] if dtype == torch.float32 else 2 * TOL[dtype]
        torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.gpu
def test_kernel_strided_planes_and_block():
    # deep/ring as views into larger per-layer buffers (gathered planes keep their pool's strides), the block
    # a non-contiguous slice of a fused qkv-like buffer.
    lens, block_len, heads, kv_heads, head_dim, window = [20, 7], 5, 8, 2, 64, 6
    gen = torch.Generator().manual_seed(5)
    big = lambda *s: torch.randn(*s, generator=gen).cuda()  # noqa: E731
    q = big(2, block_len, heads, head_dim)
    fused = big(2, block_len, 3, kv_heads, head_dim)
    bk, bv = fused[:, :, 1], fused[:, :, 2]
    planes = big(2, 30, 4, kv_heads, head_dim)  # [B, T, planes, Hkv, D]
    dk, dv = planes[:, :, 3], planes[:, :, 2]
    ring = big(2, 2, window, kv_heads, head_dim)
    rk, rv = ring[:, 0], ring[:, 1]
    cl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = ripe_attention(q, bk, bv, dk, dv, rk, rv, cl, window, 0.125)
    args = [t.cpu() for t in (q, bk, bv, dk, dv, rk, rv, cl)]
    torch.testing.assert_close(out.cpu(), ripe_attention_reference(*args, window, 0.125), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_kernel_rejects_bad_arguments_and_out_of_range_lengths():
    args = list(make_inputs([6, 3], 2, 4, 2, 8, 3, 3, device="cuda", poison=False))
    with pytest.raises(RuntimeError, match=r"ring capacity C=3 < window W=4"):
        torch.ops.ridgefill.ripe_attention(*args, 4, 0.5)
    with pytest.raises(RuntimeError, match=r"cache_lens must be int32"):
        torch.ops.ridgefill.ripe_attention(*args[:-1], args[-1].long(), 3, 0.5)
    # t0 > T is not checked on the host (it would sync): those sequences come back NaN, the others intact.
    lens = torch.tensor([6, 50], dtype=torch.int32, device="cuda")
    out = torch.ops.ridgefill.ripe_attention(*args[:-1], lens, 3, 0.5)
    assert out[1].isnan().all() and not out[0].isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_opcheck(dtype):
    op = torch.ops.ridgefill.ripe_attention.default
    for window, capacity in ((3, 3), (0, 1)):
        args = make_inputs([9, 4], 3, 4, 2, 32, window, capacity, dtype, device="cuda", seed=7, poison=False)
        torch.library.opcheck(op, (*args, window, 0.2))
