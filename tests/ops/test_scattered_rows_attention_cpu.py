"""The compiled CPU kernel of scattered_rows_attention (csrc/cpu/scattered_rows_attention_cpu.cpp) against an
independent float64 computation (per row, per head, in float64 torch math; not the module's reference).

The runtime's batched paged attention: one call holds decode rows at the end of their sequence, a prefill chunk
continuing a cached context and scattered exact rows at arbitrary positions, reading K/V in place through shuffled
block tables (unused slots hold NaN, so a wrong read shows). Without the compiled extension the public wrapper runs
the torch reference and these tests check that instead.

Tolerances: float32 outputs within 1e-5 of the float64 answer on the same inputs (|out| is O(1): V ~ N(0, 1));
bfloat16 adds the output's rounding (2^-8 relative) to that. key_mass is fp32 math for every dtype.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from ridgefill_runtime import ops
from ridgefill_runtime.ops import scattered_rows_attention, scattered_rows_attention_reference

SPLIT_ENV = "RIDGEFILL_CPU_ATTN_SPLIT"  # "0": never split the keys, "1": split every item > 256 keys
D = 64


def compiled() -> bool:
    return bool(sys.modules["ridgefill_runtime.ops.scattered_rows_attention"]._CPU_KERNEL)


def make_cache(context_lens, kv_heads, head_dim, block_size, dtype, seed=0, spare_blocks=5, interleaved=False):
    """B sequences in shuffled physical blocks of one slab pair; NaN in every slot no sequence owns. With
    interleaved, K and V are views of one [S, 2, Hkv, D] pool (slot stride 2 * Hkv * D), as a fused pool would be."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(context_lens)
    max_blocks = max(1, max(math.ceil(n / block_size) for n in context_lens)) + 1  # a spare column
    num_blocks = batch * max_blocks + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm[: batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    pool = torch.full((num_blocks * block_size, 2, kv_heads, head_dim), float("nan"))
    for b, n in enumerate(context_lens):
        pos = torch.arange(n)
        slot = tables[b].long()[pos // block_size] * block_size + pos % block_size
        pool[slot] = torch.randn(n, 2, kv_heads, head_dim, generator=gen)
    pool = pool.to(dtype)
    if interleaved:
        k_slab, v_slab = pool[:, 0], pool[:, 1]
    else:
        k_slab, v_slab = pool[:, 0].contiguous(), pool[:, 1].contiguous()
    return k_slab, v_slab, tables, torch.tensor(context_lens, dtype=torch.int32)


def naive_f64(q, q_seq, q_pos, k_slab, v_slab, tables, block_size, scale, window=0):
    """Per row and head in float64: gather the row's visible keys by the block table (with a window,
    only those in it), an explicit softmax over them, the weighted sum."""
    rows, heads, head_dim = q.shape
    group = heads // k_slab.shape[1]
    out = torch.zeros(rows, heads, head_dim, dtype=torch.float64)
    mass = torch.zeros(tables.shape[0], tables.shape[1] * block_size, dtype=torch.float64)
    for r in range(rows):
        b, p = int(q_seq[r]), int(q_pos[r])
        lo = window_first(p, window)
        pos = torch.arange(lo, p + 1)
        slots = tables[b].long()[pos // block_size] * block_size + pos % block_size
        k, v = k_slab[slots].double(), v_slab[slots].double()  # [n, Hkv, D]
        for h in range(heads):
            s = (k[:, h // group] @ q[r, h].double()) * scale  # [n]
            e = torch.exp(s - s.max())
            w = e / e.sum()
            out[r, h] = w @ v[:, h // group]
            mass[b, lo : p + 1] += w
    return out, mass


def mixed_batch(heads, kv_heads, block_size, dtype, seed=0, q_scale=1.0):
    """Decode rows at the end of contexts of 1, 2, 700 and 4096 keys, a 40-row prefill chunk continuing a
    300-key cached context, scattered rows at arbitrary positions, and one sequence without rows; the rows in
    shuffled order."""
    lens = [1, 700, 340, 4096, 129, 2, 17]
    k_slab, v_slab, tables, ctx = make_cache(lens, kv_heads, D, block_size, dtype, seed=seed)
    rows = [(0, 0), (1, 699), (3, 4095), (5, 1)]  # decode
    rows += [(2, p) for p in range(300, 340)]  # prefill chunk over a cached prefix
    rows += [(3, p) for p in (0, 1, 15, 16, 17, 255, 256, 257, 1000, 2047, 3001)] + [(1, 3), (6, 9), (5, 0)]
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed + 1)).tolist()
    rows = [rows[i] for i in perm]
    q_seq = torch.tensor([b for b, _ in rows], dtype=torch.int32)
    q_pos = torch.tensor([p for _, p in rows], dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed + 2)
    q = (q_scale * torch.randn(len(rows), heads, D, generator=gen)).to(dtype)
    return q, q_seq, q_pos, k_slab, v_slab, tables, ctx


def assert_out_close(out, exact, dtype):
    assert out.dtype == dtype and out.shape == exact.shape and not out.isnan().any()
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.double(), exact, rtol=2.0**-8, atol=1e-4)


def assert_mass_close(mass, exact):
    assert mass.dtype == torch.float32 and mass.shape == exact.shape
    torch.testing.assert_close(mass.double(), exact, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", [(3, 3), (9, 3), (8, 2)], ids=["g1", "g3", "g4"])
def test_mixed_batch_matches_f64(heads, kv_heads, block_size, dtype, monkeypatch):
    q, q_seq, q_pos, k_slab, v_slab, tables, ctx = mixed_batch(heads, kv_heads, block_size, dtype)
    scale = D**-0.5
    args = (q, q_seq, q_pos, k_slab, v_slab, tables, ctx, block_size, scale)
    exact_out, exact_mass = naive_f64(*args[:6], block_size, scale)
    out, none = scattered_rows_attention(*args)
    assert none.shape == (0,)
    assert_out_close(out, exact_out, dtype)
    out_m, mass = scattered_rows_attention(*args, True)
    assert_out_close(out_m, exact_out, dtype)
    assert_mass_close(mass, exact_mass)
    assert float(mass[4].abs().sum()) == 0.0  # the sequence without rows
    per_seq = torch.bincount(q_seq.long(), minlength=len(ctx)).double() * heads  # one unit per row and head
    torch.testing.assert_close(mass.double().sum(1), per_seq, rtol=1e-5, atol=1e-5)
    # Forcing the split-KV path everywhere (rows > 256 keys in chunks) changes nothing beyond rounding.
    monkeypatch.setenv(SPLIT_ENV, "1")
    out_split, _ = scattered_rows_attention(*args)
    assert_out_close(out_split, exact_out, dtype)


# float16 rows are widened, and on AVX-512 their V pass runs a group's heads together (accumulate_group):
# g2, g4 one pass of two / four heads; g5 four, then one head alone; g7 four, then three.
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 2), (10, 2), (14, 2)], ids=["g2", "g4", "g5", "g7"])
@pytest.mark.parametrize("slab_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_float32_queries_over_a_narrow_cache_match_f64(slab_dtype, heads, kv_heads, monkeypatch):
    """cache.kv_dtype: float32 queries read bfloat16 / float16 slabs as stored; the queries and the
    output stay float32, so the result is the float64 answer on the stored (rounded) K/V within the
    float32 bound."""
    q, q_seq, q_pos, k_slab, v_slab, tables, ctx = mixed_batch(heads, kv_heads, 16, slab_dtype)
    q = torch.randn(q.shape, generator=torch.Generator().manual_seed(9))  # float32, never rounded
    scale = D**-0.5
    exact_out, exact_mass = naive_f64(q, q_seq, q_pos, k_slab, v_slab, tables, 16, scale)
    out, mass = scattered_rows_attention(q, q_seq, q_pos, k_slab, v_slab, tables, ctx, 16, scale, True)
    assert_out_close(out, exact_out, torch.float32)
    assert_mass_close(mass, exact_mass)
    monkeypatch.setenv(SPLIT_ENV, "1")
    out_split, _ = scattered_rows_attention(q, q_seq, q_pos, k_slab, v_slab, tables, ctx, 16, scale)
    assert_out_close(out_split, exact_out, torch.float32)


@pytest.mark.parametrize("context", [1, 2, 15, 16, 17, 255, 257, 1000, 4096])
def test_context_lengths(context):
    """One sequence: its decode row and a few rows before it, fp32, GQA 3, block size 16."""
    k_slab, v_slab, tables, ctx = make_cache([context], 3, D, 16, torch.float32, seed=context)
    q_pos = torch.tensor(sorted({context - 1, context // 2, 0, max(0, context - 17)}), dtype=torch.int64)
    q_seq = torch.zeros(len(q_pos), dtype=torch.int32)
    q = torch.randn(len(q_pos), 9, D, generator=torch.Generator().manual_seed(7))
    args = (q, q_seq, q_pos, k_slab, v_slab, tables, ctx, 16, D**-0.5)
    exact_out, exact_mass = naive_f64(*args[:6], 16, D**-0.5)
    out, mass = scattered_rows_attention(*args, True)
    assert_out_close(out, exact_out, torch.float32)
    assert_mass_close(mass, exact_mass)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_strided_slabs_peaked_scores_odd_head_dim(dtype):
    """K and V as views of one fused pool (slot stride 2 * Hkv * D), head dim 40 (a 32-block, then a scalar tail),
    and scores of std ~30 so the softmax is nearly one-hot and most exp(s - max) underflow.

    Logits that large are ill-conditioned in fp32: a score carries an absolute rounding error of a few units of
    2^-24 * sum_d |q_d k_d|, and the output moves by up to twice that times max |v|. The bound below allows four
    such units over the largest sum in the batch (computed in float64), on top of the usual 1e-5."""
    k_slab, v_slab, tables, ctx = make_cache([600, 33], 2, 40, 16, dtype, seed=3, interleaved=True)
    assert not k_slab.is_contiguous()
    q_seq = torch.tensor([0, 0, 1, 0, 1], dtype=torch.int32)
    q_pos = torch.tensor([599, 300, 32, 7, 0])
    q = (5 * torch.randn(5, 8, 40, generator=torch.Generator().manual_seed(4))).to(dtype)
    args = (q, q_seq, q_pos, k_slab, v_slab, tables, ctx, 16, 1.0)
    exact_out, exact_mass = naive_f64(*args[:6], 16, 1.0)
    out, mass = scattered_rows_attention(*args, True)
    magnitude = 0.0  # max over rows, heads and visible keys of sum_d |q_d k_d|
    for r in range(len(q_pos)):
        pos = torch.arange(int(q_pos[r]) + 1)
        slots = tables[int(q_seq[r])].long()[pos // 16] * 16 + pos % 16
        k = k_slab[slots].double().abs().repeat_interleave(4, dim=1)  # [n, H, D]
        magnitude = max(magnitude, float(torch.einsum("hd,nhd->nh", q[r].double().abs(), k).max()))
    vmax = float(v_slab.double().nan_to_num().abs().max())
    atol = 1e-5 + 2 * vmax * 4 * 2.0**-24 * magnitude
    rtol = {torch.float32: 1e-5, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.double(), exact_out, rtol=rtol, atol=atol)
    assert_mass_close(mass, exact_mass)


def test_split_and_unsplit_agree(monkeypatch):
    """A single decode row over 4096 keys (SmolLM2's 9 heads / 3 KV heads): the split-KV path (auto on >= 2
    threads, or forced) and the one-task-per-item path give the same answer, and both match float64."""
    k_slab, v_slab, tables, ctx = make_cache([4096], 3, D, 16, torch.float32, seed=11)
    q = torch.randn(1, 9, D, generator=torch.Generator().manual_seed(12))
    args = (q, torch.zeros(1, dtype=torch.int32), torch.tensor([4095]), k_slab, v_slab, tables, ctx, 16, D**-0.5)
    exact_out, _ = naive_f64(*args[:6], 16, D**-0.5)
    monkeypatch.setenv(SPLIT_ENV, "0")
    whole, _ = scattered_rows_attention(*args)
    monkeypatch.setenv(SPLIT_ENV, "1")
    split, _ = scattered_rows_attention(*args)
    monkeypatch.delenv(SPLIT_ENV)
    auto, _ = scattered_rows_attention(*args)
    with_mass, _ = scattered_rows_attention(*args, True)
    for out in (whole, split, auto, with_mass):
        assert_out_close(out, exact_out, torch.float32)
    torch.testing.assert_close(split, whole, rtol=1e-6, atol=1e-6)
    assert torch.equal(with_mass, auto)  # same path: key_mass only adds a pass
    if compiled():
        # Evidence that two different summations ran (16 chunks merged by log-sum-exp vs one pass).
        assert not torch.equal(split, whole)


@pytest.mark.parametrize("split", ["0", "1", None], ids=["whole", "split", "auto"])
def test_rows_longer_than_one_softmax_pass(split, monkeypatch):
    """Rows over 4096 keys: one task runs several softmax passes and merges them (or split-KV chunks do)."""
    if split is None:
        monkeypatch.delenv(SPLIT_ENV, raising=False)
    else:
        monkeypatch.setenv(SPLIT_ENV, split)
    k_slab, v_slab, tables, ctx = make_cache([9000, 5000], 3, D, 16, torch.float32, seed=13)
    q_seq = torch.tensor([0, 1, 0, 1], dtype=torch.int32)
    q_pos = torch.tensor([8999, 4999, 4100, 4095])
    q = torch.randn(4, 9, D, generator=torch.Generator().manual_seed(14))
    args = (q, q_seq, q_pos, k_slab, v_slab, tables, ctx, 16, D**-0.5)
    exact_out, exact_mass = naive_f64(*args[:6], 16, D**-0.5)
    out, mass = scattered_rows_attention(*args, True)
    assert_out_close(out, exact_out, torch.float32)
    assert_mass_close(mass, exact_mass)


def test_thread_count_does_not_change_unsplit_results(monkeypatch):
    q, q_seq, q_pos, k_slab, v_slab, tables, ctx = mixed_batch(9, 3, 16, torch.float32, seed=5)
    args = (q, q_seq, q_pos, k_slab, v_slab, tables, ctx, 16, D**-0.5, True)
    monkeypatch.setenv(SPLIT_ENV, "0")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = scattered_rows_attention(*args)
        torch.set_num_threads(2)
        two = scattered_rows_attention(*args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_empty_row_set():
    k_slab, v_slab, tables, ctx = make_cache([9, 4], 2, D, 4, torch.float32)
    empty = (
        torch.zeros(0, 6, D),
        torch.zeros(0, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int64),
        k_slab,
        v_slab,
        tables,
        ctx,
        4,
        0.3,
    )
    out, mass = scattered_rows_attention(*empty, True)
    assert out.shape == (0, 6, D) and mass.shape == (2, tables.shape[1] * 4) and float(mass.abs().sum()) == 0.0
    out, none = scattered_rows_attention(*empty)
    assert out.shape == (0, 6, D) and none.shape == (0,)


def test_bad_inputs_raise_clear_errors():
    k_slab, v_slab, tables, ctx = make_cache([5, 3], 2, 8, 4, torch.float32)
    k_slab, v_slab = k_slab.nan_to_num(), v_slab.nan_to_num()
    q = torch.randn(1, 4, 8)
    seq0 = torch.zeros(1, dtype=torch.int32)
    pos1 = torch.tensor([1])

    def call(
        q=q,
        q_seq=seq0,
        q_pos=pos1,
        k=k_slab,
        v=v_slab,
        tables=tables,
        ctx=ctx,
    ):
        return scattered_rows_attention(q, q_seq, q_pos, k, v, tables, ctx, 4, 1.0)

    with pytest.raises(ValueError, match=r"q_pos must be in \[0, context_lens\[q_seq\]\)"):
        call(q_pos=torch.tensor([5]))  # q_pos == context_lens[0]
    with pytest.raises(ValueError, match="q_pos"):
        call(q_seq=torch.ones(1, dtype=torch.int32), q_pos=torch.tensor([3]))
    with pytest.raises(ValueError, match="q_pos"):
        call(q_pos=torch.tensor([-1]))
    with pytest.raises(ValueError, match="q_seq out of range"):
        call(q_seq=torch.tensor([2], dtype=torch.int32))
    with pytest.raises(ValueError, match="longer than its block table"):
        call(ctx=torch.tensor([5, 4 * tables.shape[1] + 1], dtype=torch.int32))
    with pytest.raises(TypeError, match="int64"):
        call(q_pos=torch.tensor([1], dtype=torch.int32))
    with pytest.raises(TypeError, match="share a float dtype"):
        call(q=q.bfloat16())
    with pytest.raises(TypeError, match="share a float dtype"):  # narrow queries over a float32 cache
        call(q=q.half())
    with pytest.raises(ValueError, match="multiple of Hkv"):
        call(q=torch.randn(1, 3, 8))
    bad_tables = tables.clone()
    bad_tables[0, 1] = 10_000
    with pytest.raises(IndexError):
        call(q_pos=torch.tensor([4]), tables=bad_tables)


def test_compiled_kernel_is_the_cpu_path():
    """With the extension the CPU dispatch key has the C++ kernel (no Python one) and the wrapper calls it; an
    extension without it (pure Python, or a _C built before the kernel existed) leaves the wrapper on the reference."""
    has_kernel = ops.extension_loaded() and torch._C._dispatch_has_kernel_for_dispatch_key(
        "ridgefill::scattered_rows_attention", "CPU"
    )
    assert compiled() == has_kernel
    if os.environ.get("RIDGEFILL_REQUIRE_EXTENSION") == "1":
        assert has_kernel, "RIDGEFILL_REQUIRE_EXTENSION=1 but ridgefill_runtime._C has no CPU scattered_rows_attention"
    if not has_kernel:
        return
    q, q_seq, q_pos, k_slab, v_slab, tables, ctx = mixed_batch(9, 3, 16, torch.bfloat16, seed=9)
    args = (q, q_seq, q_pos, k_slab, v_slab, tables, ctx, 16, D**-0.5, True)
    direct = torch.ops.ridgefill.scattered_rows_attention(*args)
    wrapped = scattered_rows_attention(*args)
    assert torch.equal(direct[0], wrapped[0]) and torch.equal(direct[1], wrapped[1])
    with pytest.raises(ValueError, match="q_pos"):
        torch.ops.ridgefill.scattered_rows_attention(q, q_seq, q_pos + 5000, *args[3:])
    k_small, v_small, t_small, c_small = make_cache([7, 4], 2, 8, 4, torch.float32, seed=2)
    q_small = torch.randn(3, 4, 8)
    for mass in (True, False):
        torch.library.opcheck(
            torch.ops.ridgefill.scattered_rows_attention.default,
            (
                q_small,
                torch.tensor([0, 0, 1], dtype=torch.int32),
                torch.tensor([2, 6, 3]),
                k_small.nan_to_num(),
                v_small.nan_to_num(),
                t_small,
                c_small,
                4,
                0.3,
                mass,
            ),
        )


# ---------------------------------------------------------------------------
# Sliding window (window > 0: a row at p sees the keys j with p - j < window; Gemma 3's local layers).


def window_first(p: int, window: int) -> int:
    return max(0, p - window + 1) if window > 0 else 0


def make_window_cache(context_lens, rows, window, kv_heads, head_dim, block_size, dtype, seed=0):
    """Like make_cache, but only the keys some row's window covers are written: every other slot, including the
    slots of the same sequence before and between the windows, holds NaN, so a read outside a window shows."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(context_lens)
    max_blocks = max(1, max(math.ceil(n / block_size) for n in context_lens)) + 1
    num_blocks = batch * max_blocks + 3
    tables = torch.randperm(num_blocks, generator=gen)[: batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    k_slab = torch.full((num_blocks * block_size, kv_heads, head_dim), float("nan"))
    v_slab = torch.full((num_blocks * block_size, kv_heads, head_dim), float("nan"))
    needed = [set() for _ in context_lens]
    for b, p in rows:
        needed[b].update(range(window_first(p, window), p + 1))
    for b, keys in enumerate(needed):
        pos = torch.tensor(sorted(keys), dtype=torch.long)
        if len(pos) == 0:
            continue
        slot = tables[b].long()[pos // block_size] * block_size + pos % block_size
        k_slab[slot] = torch.randn(len(pos), kv_heads, head_dim, generator=gen)
        v_slab[slot] = torch.randn(len(pos), kv_heads, head_dim, generator=gen)
    return k_slab.to(dtype), v_slab.to(dtype), tables, torch.tensor(context_lens, dtype=torch.int32)


def window_batch(window, heads, kv_heads, block_size, dtype, seed=0):
    """Decode rows, a prefill chunk over a cached prefix and scattered rows (some far apart in one sequence, so
    NaN lies between their windows), shuffled; caches hold only what the windows need."""
    lens = [1, 700, 340, 4096, 129, 2]
    rows = [(0, 0), (1, 699), (3, 4095), (5, 1)]
    rows += [(2, p) for p in range(300, 340)]
    rows += [(3, p) for p in (0, 1, 2, 15, 16, 17, 255, 256, 1000, 2047, 3001)] + [(1, 3), (4, 128), (5, 0)]
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed + 1)).tolist()
    rows = [rows[i] for i in perm]
    k_slab, v_slab, tables, ctx = make_window_cache(lens, rows, window, kv_heads, D, block_size, dtype, seed=seed)
    q_seq = torch.tensor([b for b, _ in rows], dtype=torch.int32)
    q_pos = torch.tensor([p for _, p in rows], dtype=torch.int64)
    q = torch.randn(len(rows), heads, D, generator=torch.Generator().manual_seed(seed + 2)).to(dtype)
    return q, q_seq, q_pos, k_slab, v_slab, tables, ctx


def assert_window_mass(mass, exact, q_seq, q_pos, heads, window):
    assert_mass_close(mass, exact)
    # One unit per row and head, all of it on keys inside that row's window.
    per_seq = torch.bincount(q_seq.long(), minlength=mass.shape[0]).double() * heads
    torch.testing.assert_close(mass.double().sum(1), per_seq, rtol=1e-5, atol=1e-5)
    seen = torch.zeros(mass.shape, dtype=torch.bool)
    for b, p in zip(q_seq.tolist(), q_pos.tolist()):
        seen[b, window_first(p, window) : p + 1] = True
    assert float(mass[~seen].abs().sum()) == 0.0


@pytest.mark.parametrize("split", ["0", "1", None], ids=["whole", "split", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads", [(3, 3), (9, 3)], ids=["g1", "g3"])
@pytest.mark.parametrize("window", [1, 3, 512])
def test_window_mixed_batch_matches_f64(window, heads, kv_heads, dtype, split, monkeypatch):
    if split is None:
        monkeypatch.delenv(SPLIT_ENV, raising=False)
    else:
        monkeypatch.setenv(SPLIT_ENV, split)
    q, q_seq, q_pos, k_slab, v_slab, tables, ctx = window_batch(window, heads, kv_heads, 16, dtype, seed=window)
    assert k_slab.isnan().any()  # keys no window covers are poison
    args = (q, q_seq, q_pos, k_slab, v_slab, tables, ctx, 16, D**-0.5)
    exact_out, exact_mass = naive_f64(*args[:6], 16, D**-0.5, window)
    out, none = scattered_rows_attention(*args, False, window)
    assert none.shape == (0,)
    assert_out_close(out, exact_out, dtype)
    out_m, mass = scattered_rows_attention(*args, True, window)
    assert_out_close(out_m, exact_out, dtype)
    assert_window_mass(mass, exact_mass, q_seq, q_pos, heads, window)


def test_window_longer_than_context_is_full_attention():
    """A window past every row's position changes nothing: bitwise today's (window=0) answer and key mass."""
    q, q_seq, q_pos, k_slab, v_slab, tables, ctx = mixed_batch(9, 3, 16, torch.float32, seed=21)
    args = (q, q_seq, q_pos, k_slab, v_slab, tables, ctx, 16, D**-0.5, True)
    full = scattered_rows_attention(*args)
    for window in (4096, 4097, 1 << 40):
        windowed = scattered_rows_attention(*args, window)
        assert torch.equal(windowed[0], full[0]) and torch.equal(windowed[1], full[1])
    exact_out, exact_mass = naive_f64(*args[:6], 16, D**-0.5, 4097)
    assert_out_close(full[0], exact_out, torch.float32)
    assert_mass_close(full[1], exact_mass)


@pytest.mark.parametrize("split", ["0", "1", None], ids=["whole", "split", "auto"])
@pytest.mark.parametrize("window", [512, 5000])
def test_window_long_contexts_split_kv(window, split, monkeypatch):
    """9000 and 5000 keys, GQA 3: window 512 leaves each row 512 keys (two split-KV chunks when forced);
    window 5000 leaves the last row 5000 keys starting at 4000 (several softmax passes, or split chunks)."""
    if split is None:
        monkeypatch.delenv(SPLIT_ENV, raising=False)
    else:
        monkeypatch.setenv(SPLIT_ENV, split)
    rows = [(0, 8999), (1, 4999), (0, 4100), (1, 4095), (0, 600), (0, 10)]
    k_slab, v_slab, tables, ctx = make_window_cache([9000, 5000], rows, window, 3, D, 16, torch.float32, seed=31)
    q_seq = torch.tensor([b for b, _ in rows], dtype=torch.int32)
    q_pos = torch.tensor([p for _, p in rows])
    q = torch.randn(len(rows), 9, D, generator=torch.Generator().manual_seed(32))
    args = (q, q_seq, q_pos, k_slab, v_slab, tables, ctx, 16, D**-0.5)
    exact_out, exact_mass = naive_f64(*args[:6], 16, D**-0.5, window)
    out, mass = scattered_rows_attention(*args, True, window)
    assert_out_close(out, exact_out, torch.float32)
    assert_window_mass(mass, exact_mass, q_seq, q_pos, 9, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_window_nan_outside_does_not_leak(dtype, monkeypatch):
    """One decode row at 4095 with window 3 (GQA 4): only keys 4093..4095 are written, everything else in the
    slabs is NaN (as a sliding-window cache that recycled its slots may hold), and the table entries of the
    blocks wholly before the window are unmapped (-1): the answer is finite and right, split or not."""
    rows = [(0, 4095)]
    k_slab, v_slab, tables, ctx = make_window_cache([4096], rows, 3, 2, D, 16, dtype, seed=41)
    assert int((~k_slab.isnan()).all(dim=(1, 2)).sum()) == 3
    tables[0, : 4093 // 16] = -1
    q = torch.randn(1, 8, D, generator=torch.Generator().manual_seed(42)).to(dtype)
    args = (q, torch.zeros(1, dtype=torch.int32), torch.tensor([4095]), k_slab, v_slab, tables, ctx, 16, D**-0.5)
    exact_out, exact_mass = naive_f64(*args[:6], 16, D**-0.5, 3)
    for split in ("0", "1"):
        monkeypatch.setenv(SPLIT_ENV, split)
        out, mass = scattered_rows_attention(*args, True, 3)
        assert out.isfinite().all() and mass.isfinite().all()
        rtol = {torch.float32: 1e-5, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
        torch.testing.assert_close(out.double(), exact_out, rtol=rtol, atol=1e-4 if dtype != torch.float32 else 1e-5)
        assert_window_mass(mass, exact_mass, args[1], args[2], 8, 3)


def test_window_one_sees_only_itself():
    """window=1: each row's output is its own V row exactly (a one-key softmax is 1), key mass H per row."""
    rows = [(0, 0), (0, 5), (1, 9), (0, 30)]
    k_slab, v_slab, tables, ctx = make_window_cache([31, 10], rows, 1, 2, D, 4, torch.float32, seed=51)
    q_seq = torch.tensor([b for b, _ in rows], dtype=torch.int32)
    q_pos = torch.tensor([p for _, p in rows])
    q = torch.randn(len(rows), 6, D, generator=torch.Generator().manual_seed(52))
    out, mass = scattered_rows_attention(q, q_seq, q_pos, k_slab, v_slab, tables, ctx, 4, D**-0.5, True, 1)
    for r, (b, p) in enumerate(rows):
        slot = int(tables[b, p // 4]) * 4 + p % 4
        torch.testing.assert_close(out[r], v_slab[slot].repeat_interleave(3, dim=0), rtol=1e-6, atol=1e-6)
        assert float(mass[b, p]) == pytest.approx(6.0, rel=1e-6)
    assert float(mass.sum()) == pytest.approx(6.0 * len(rows), rel=1e-6)


def test_bad_window_raises_clear_errors():
    k_slab, v_slab, tables, ctx = make_cache([5, 3], 2, 8, 4, torch.float32)
    args = (
        torch.randn(1, 4, 8),
        torch.zeros(1, dtype=torch.int32),
        torch.tensor([1]),
        k_slab.nan_to_num(),
        v_slab.nan_to_num(),
        tables,
        ctx,
        4,
        1.0,
        False,
    )
    with pytest.raises(ValueError, match=r"window must be >= 0"):
        scattered_rows_attention(*args, -1)
    with pytest.raises(TypeError, match="window must be an int"):
        scattered_rows_attention(*args, 2.5)
    with pytest.raises(TypeError, match="window must be an int"):
        scattered_rows_attention(*args, True)
    with pytest.raises(ValueError, match=r"window must be >= 0"):
        scattered_rows_attention_reference(*args, -3)
    if compiled():
        with pytest.raises(ValueError, match=r"window must be >= 0 \(0 = no sliding window\), got -2"):
            torch.ops.ridgefill.scattered_rows_attention(*args, -2)


def test_window_default_and_compiled_schema():
    """window defaults to 0 (callers without it unchanged): in the wrapper and, compiled, in the op's schema,
    whose fake accepts the argument (opcheck)."""
    k_small, v_small, t_small, c_small = make_cache([7, 4], 2, 8, 4, torch.float32, seed=2)
    base = (
        torch.randn(3, 4, 8),
        torch.tensor([0, 0, 1], dtype=torch.int32),
        torch.tensor([2, 6, 3]),
        k_small.nan_to_num(),
        v_small.nan_to_num(),
        t_small,
        c_small,
        4,
        0.3,
        True,
    )
    default = scattered_rows_attention(*base)
    explicit = scattered_rows_attention(*base, 0)
    assert torch.equal(default[0], explicit[0]) and torch.equal(default[1], explicit[1])
    narrow = scattered_rows_attention(*base, 2)
    assert not torch.equal(narrow[0], default[0])  # the row at 6 loses keys 0..4
    if not compiled():
        return
    default = torch.ops.ridgefill.scattered_rows_attention(*base)
    explicit = torch.ops.ridgefill.scattered_rows_attention(*base, 0)
    assert torch.equal(default[0], explicit[0]) and torch.equal(default[1], explicit[1])
    for window in (1, 2, 100):
        torch.library.opcheck(torch.ops.ridgefill.scattered_rows_attention.default, base + (window,))
