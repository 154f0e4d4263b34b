"""scattered_rows_attention against a float64 loop over rows, heads and keys, on a real paged layout
(shuffled physical blocks, odd block size, GQA), plus the key-mass the probe selector reads."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ridgefill_runtime import ops
from ridgefill_runtime.layers.attention import attend_at
from ridgefill_runtime.ops import scattered_rows_attention, scattered_rows_attention_reference

TOL = {torch.float32: 2e-6, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # output unit roundoff (fp32: sum noise)
DTYPES = list(TOL)


def make_cache(context_lens, heads, kv_heads, head_dim, block_size, dtype, device="cpu", seed=0, spare_blocks=3):
    """A KV slab holding B sequences in shuffled physical blocks, plus poison (NaN) in every unused slot."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(context_lens)
    max_blocks = max(1, max(math.ceil(n / block_size) for n in context_lens)) + 1  # one spare column
    num_blocks = batch * max_blocks + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = perm[: batch * max_blocks].view(batch, max_blocks).to(torch.int32)  # [B, max_blocks]
    slots = num_blocks * block_size
    k_slab = torch.full((slots, kv_heads, head_dim), float("nan"))
    v_slab = torch.full((slots, kv_heads, head_dim), float("nan"))
    for b, n in enumerate(context_lens):
        pos = torch.arange(n)
        slot = block_tables[b].long()[pos // block_size] * block_size + pos % block_size
        k_slab[slot] = torch.randn(n, kv_heads, head_dim, generator=gen)
        v_slab[slot] = torch.randn(n, kv_heads, head_dim, generator=gen)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    q_all = torch.randn(sum(context_lens), heads, head_dim, generator=gen)
    cast = lambda t: t.to(dtype).to(device)  # noqa: E731
    return cast(q_all), cast(k_slab), cast(v_slab), block_tables.to(device), lens.to(device)


def pick_rows(context_lens, fraction, seed, device="cpu"):
    """A sorted random subset: (row indices into q_all, q_seq int32, q_pos int64)."""
    gen = torch.Generator().manual_seed(seed)
    seqs, poss = [], []
    for b, n in enumerate(context_lens):
        keep = (torch.rand(n, generator=gen) < fraction).nonzero().flatten()
        seqs += [b] * len(keep)
        poss += keep.tolist()
    offsets = [0]
    for n in context_lens:
        offsets.append(offsets[-1] + n)
    rows = torch.tensor([offsets[b] + p for b, p in zip(seqs, poss)], dtype=torch.long)
    return (
        rows.to(device),
        torch.tensor(seqs, dtype=torch.int32, device=device),
        torch.tensor(poss, dtype=torch.int64, device=device),
    )


def naive_f64(q, q_seq, q_pos, k_slab, v_slab, block_tables, block_size, scale, max_ctx, window=0):
    """Plain loops in Python floats; with window > 0 a row at p sees only the keys max(0, p - window + 1)..p."""
    rows, heads, head_dim = q.shape
    group = heads // k_slab.shape[1]
    qd, kd, vd = q.double().tolist(), k_slab.double().tolist(), v_slab.double().tolist()
    tables = block_tables.tolist()
    out = [[[0.0] * head_dim for _ in range(heads)] for _ in range(rows)]
    mass = [[0.0] * max_ctx for _ in range(block_tables.shape[0])]
    for r in range(rows):
        b, p = int(q_seq[r]), int(q_pos[r])
        lo = max(0, p - window + 1) if window > 0 else 0
        slots = [tables[b][j // block_size] * block_size + j % block_size for j in range(lo, p + 1)]
        for h in range(heads):
            kvh = h // group
            s = [scale * math.fsum(a * c for a, c in zip(qd[r][h], kd[slot][kvh])) for slot in slots]
            top = max(s)
            e = [math.exp(x - top) for x in s]
            z = math.fsum(e)
            probs = [x / z for x in e]
            for j, pj in enumerate(probs, start=lo):
                mass[b][j] += pj
            for d in range(head_dim):
                out[r][h][d] = math.fsum(pj * vd[slot][kvh][d] for pj, slot in zip(probs, slots))
    return torch.tensor(out, dtype=torch.float64).view(rows, heads, head_dim), torch.tensor(mass, dtype=torch.float64)


CASES = [
    # (context lens, H, Hkv, D, block size, fraction of rows kept)
    ([1, 17, 40], 6, 2, 24, 5, 0.3),
    ([33], 4, 4, 16, 8, 1.0),
    ([7, 1, 12, 3], 8, 1, 8, 3, 0.5),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"lens{c[0]}-H{c[1]}-Hkv{c[2]}-D{c[3]}-bs{c[4]}")
def test_reference_matches_naive_f64(case, dtype):
    lens, heads, kv_heads, head_dim, block_size, fraction = case
    q_all, k_slab, v_slab, tables, ctx = make_cache(lens, heads, kv_heads, head_dim, block_size, dtype, seed=len(lens))
    rows, q_seq, q_pos = pick_rows(lens, fraction, seed=heads)
    q = q_all[rows]
    scale = head_dim**-0.5
    out, mass = scattered_rows_attention_reference(
        q, q_seq, q_pos, k_slab, v_slab, tables, ctx, block_size, scale, True
    )
    exp_out, exp_mass = naive_f64(
        q, q_seq, q_pos, k_slab, v_slab, tables, block_size, scale, tables.shape[1] * block_size
    )
    assert out.dtype == dtype and out.shape == q.shape and mass.shape == exp_mass.shape
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), exp_out, rtol=tol, atol=tol)
    torch.testing.assert_close(mass.double(), exp_mass, rtol=1e-5, atol=1e-5)
    # Each row-head distributes exactly one unit of mass over its own sequence's keys.
    per_seq_rows = torch.bincount(q_seq.long(), minlength=len(lens)).double()
    torch.testing.assert_close(mass.double().sum(1), per_seq_rows * heads, rtol=1e-5, atol=1e-5)
    assert bool((mass[:, tables.shape[1] * block_size - 1] == 0).all())  # the spare block column is never read


def test_one_row_and_empty_subset():
    lens = [9, 4]
    q_all, k_slab, v_slab, tables, ctx = make_cache(lens, 4, 2, 8, 4, torch.float32, seed=1)
    one = scattered_rows_attention_reference(
        q_all[[10]], torch.tensor([1], dtype=torch.int32), torch.tensor([1]), k_slab, v_slab, tables, ctx, 4, 0.3, True
    )
    exp_out, exp_mass = naive_f64(
        q_all[[10]], torch.tensor([1]), torch.tensor([1]), k_slab, v_slab, tables, 4, 0.3, tables.shape[1] * 4
    )
    torch.testing.assert_close(one[0].double(), exp_out, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(one[1].double(), exp_mass, rtol=1e-6, atol=1e-6)
    assert float(one[1][0].abs().sum()) == 0.0 and float(one[1][1, :2].sum()) == pytest.approx(4.0)
    out, mass = scattered_rows_attention(
        q_all[:0],
        torch.zeros(0, dtype=torch.int32),
        torch.zeros(0, dtype=torch.long),
        k_slab,
        v_slab,
        tables,
        ctx,
        4,
        0.3,
        True,
    )
    assert out.shape == (0, 4, 8) and mass.shape == (2, tables.shape[1] * 4) and float(mass.abs().sum()) == 0.0
    _, no_mass = scattered_rows_attention(
        q_all[:0],
        torch.zeros(0, dtype=torch.int32),
        torch.zeros(0, dtype=torch.long),
        k_slab,
        v_slab,
        tables,
        ctx,
        4,
        0.3,
    )
    assert no_mass.shape == (0,)


def test_agrees_with_model_attention_path():
    # The runtime's current path (gather the sequence's slots, SDPA with a position mask) must give
    # the same rows: the model can swap one for the other.
    lens = [21, 13]
    q_all, k_slab, v_slab, tables, ctx = make_cache(lens, 6, 3, 16, 4, torch.float32, seed=2)
    rows, q_seq, q_pos = pick_rows(lens, 0.4, seed=3)
    out, _ = scattered_rows_attention_reference(q_all[rows], q_seq, q_pos, k_slab, v_slab, tables, ctx, 4, 0.25)
    for b, n in enumerate(lens):
        pick = (q_seq == b).nonzero().flatten()
        pos = torch.arange(n)
        slots = tables[b].long()[pos // 4] * 4 + pos % 4
        expected = attend_at(q_all[rows][pick], q_pos[pick], k_slab[slots], v_slab[slots], 0.25)  # [Rb, H*D]
        torch.testing.assert_close(out[pick].reshape(len(pick), -1), expected, rtol=1e-5, atol=1e-5)


def test_reference_rejects_bad_arguments():
    q_all, k_slab, v_slab, tables, ctx = make_cache([5], 4, 2, 8, 4, torch.float32)
    q = q_all[:1]
    seq = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="q_pos"):
        scattered_rows_attention(q, seq, torch.tensor([5]), k_slab, v_slab, tables, ctx, 4, 1.0)
    with pytest.raises(TypeError, match="int64"):
        scattered_rows_attention(q, seq, torch.tensor([1], dtype=torch.int32), k_slab, v_slab, tables, ctx, 4, 1.0)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        scattered_rows_attention(q[:, :3], seq, torch.tensor([1]), k_slab, v_slab, tables, ctx, 4, 1.0)
    with pytest.raises(TypeError, match="share a float dtype"):
        scattered_rows_attention(q.half(), seq, torch.tensor([1]), k_slab, v_slab, tables, ctx, 4, 1.0)


# ---------------------------------------------------------------------------
# CUDA kernel.


# The CUDA kernel splits long rows' keys into chunks (split-KV) when the launch has too few blocks, unless
# return_key_mass is set: a key-mass call is the unsplit kernel, the same call without it may be split.
# RIDGEFILL_CUDA_ATTN_SPLIT (0 never, 1 every row longer than 256 keys, unset = heuristic) is read once per
# process, so test_kernel_split_knob_modes reruns this file's kernel tests in subprocesses with it set.
SPLIT_MODE = os.environ.get("RIDGEFILL_CUDA_ATTN_SPLIT")
MIN_SPLIT_KEYS = 256  # kMinSplitKeys in csrc/scattered_rows_attention.cu: the forced split's chunk


def assert_split_matches_unsplit(split, unsplit):
    """Same answer up to fp32 summation order (then at most one ulp of a bfloat16/float16 output); bitwise when
    the knob forbids splitting."""
    if SPLIT_MODE == "0":
        assert torch.equal(split, unsplit)
        return
    if split.dtype == torch.float32:
        torch.testing.assert_close(split, unsplit, rtol=1e-5, atol=2e-6)
    else:
        torch.testing.assert_close(split.float(), unsplit.float(), rtol=2 * TOL[split.dtype], atol=1e-5)


def _kernel(*args):
    assert ops.extension_loaded(), f"CUDA available but extension not loaded: {ops.extension_error()}"
    q = args[0]
    torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)  # poison the caching allocator
    return torch.ops.ridgefill.scattered_rows_attention(*args)


def _torch_lowp(q, q_seq, q_pos, k_slab, v_slab, tables, block_size, scale):
    """torch's own low-precision answer: SDPA in q's dtype, one sequence at a time."""
    out = torch.empty_like(q)
    for b in q_seq.unique().tolist():
        pick = (q_seq == b).nonzero().flatten()
        pos = torch.arange(int(q_pos[pick].max()) + 1, device=q.device)
        slots = tables[b].long()[pos // block_size] * block_size + pos % block_size
        out[pick] = attend_at(q[pick], q_pos[pick], k_slab[slots], v_slab[slots], scale).view(len(pick), *q.shape[1:])
    return out


GPU_CASES = CASES + [
    ([300, 1, 1000], 32, 8, 128, 16, 0.05),  # Llama-like GQA 4, D 128
    ([2049], 16, 2, 64, 16, 0.02),  # GQA 8, D 64
    ([700, 64], 8, 1, 256, 32, 0.1),  # D 256, MQA: head chunks of 4
    ([100], 20, 1, 80, 16, 0.2),  # group 20 > MAXG: several head chunks
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"B{len(c[0])}-H{c[1]}-Hkv{c[2]}-D{c[3]}-bs{c[4]}")
def test_kernel_matches_reference(case, dtype):
    lens, heads, kv_heads, head_dim, block_size, fraction = case
    for seed in range(2):
        q_all, k_slab, v_slab, tables, ctx = make_cache(
            lens, heads, kv_heads, head_dim, block_size, dtype, device="cuda", seed=seed
        )
        rows, q_seq, q_pos = pick_rows(lens, fraction, seed=seed + 1, device="cuda")
        q = q_all[rows]
        scale = head_dim**-0.5
        args = (q, q_seq, q_pos, k_slab, v_slab, tables, ctx, block_size, scale)
        out, mass = _kernel(*args, True)
        assert out.shape == q.shape and out.dtype == dtype and not out.isnan().any()
        # Exact answer: the fp32 reference on float64 copies (the inputs are already rounded).
        exact_out, exact_mass = scattered_rows_attention_reference(
            q.double().float(), q_seq, q_pos, k_slab.float(), v_slab.float(), tables, ctx, block_size, scale, True
        )
        err = (out.float() - exact_out).abs().max().item() if out.numel() else 0.0
        if dtype == torch.float32:
            assert err <= 1e-5, err
        else:
            torch_err = (_torch_lowp(*args[:6], block_size, scale).float() - exact_out).abs().max().item()
            assert err <= 2 * torch_err + TOL[dtype], (err, torch_err)
        # Key mass is fp32 math on the same (rounded) inputs for every dtype: only summation order differs.
        torch.testing.assert_close(mass, exact_mass, rtol=1e-4, atol=1e-4)
        out2, none = _kernel(*args, False)
        assert none.shape == (0,)
        assert_split_matches_unsplit(out2, out)


@pytest.mark.gpu
def test_kernel_empty_and_one_row():
    q_all, k_slab, v_slab, tables, ctx = make_cache([9, 4], 4, 2, 8, 4, torch.bfloat16, device="cuda", seed=4)
    out, mass = _kernel(
        q_all[:0],
        torch.zeros(0, dtype=torch.int32, device="cuda"),
        torch.zeros(0, dtype=torch.long, device="cuda"),
        k_slab,
        v_slab,
        tables,
        ctx,
        4,
        0.3,
        True,
    )
    assert out.shape == (0, 4, 8) and float(mass.abs().sum()) == 0.0
    args = (
        q_all[[10]],
        torch.tensor([1], dtype=torch.int32, device="cuda"),
        torch.tensor([0], device="cuda"),
        k_slab,
        v_slab,
        tables,
        ctx,
        4,
        0.3,
        True,
    )
    out, mass = _kernel(*args)
    ref_out, ref_mass = scattered_rows_attention_reference(*[a.cpu() if torch.is_tensor(a) else a for a in args])
    torch.testing.assert_close(out.cpu(), ref_out)
    torch.testing.assert_close(mass.cpu(), ref_mass)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_opcheck(dtype):
    lens = [11, 6]
    q_all, k_slab, v_slab, tables, ctx = make_cache(lens, 4, 2, 32, 4, dtype, device="cuda", seed=5)
    # opcheck compares against the fake and checks autograd registration; NaN in unused slots is
    # never read, but opcheck may compare outputs elementwise, so fill them.
    k_slab = torch.nan_to_num(k_slab)
    v_slab = torch.nan_to_num(v_slab)
    rows, q_seq, q_pos = pick_rows(lens, 0.5, seed=6, device="cuda")
    for mass in (True, False):
        torch.library.opcheck(
            torch.ops.ridgefill.scattered_rows_attention.default,
            (q_all[rows], q_seq, q_pos, k_slab, v_slab, tables, ctx, 4, 0.2, mass),
        )


# ---------------------------------------------------------------------------
# Sliding window (window > 0: a row at p sees the keys j with p - j < window; Gemma 3's local layers).


def poison_outside_windows(k_slab, v_slab, block_tables, q_seq, q_pos, block_size, window):
    """NaN in every slot no row's window covers (a sliding-window cache may have recycled it), the slots of a
    sequence before and between its rows' windows included; returns the poisoned copies."""
    keep = torch.zeros(k_slab.shape[0], dtype=torch.bool, device=k_slab.device)
    tables = block_tables.cpu()
    for b, p in zip(q_seq.tolist(), q_pos.tolist()):
        pos = torch.arange(max(0, p - window + 1) if window > 0 else 0, p + 1)
        keep[(tables[b].long()[pos // block_size] * block_size + pos % block_size).to(k_slab.device)] = True
    nan = torch.tensor(float("nan"), dtype=k_slab.dtype, device=k_slab.device)
    return torch.where(keep[:, None, None], k_slab, nan), torch.where(keep[:, None, None], v_slab, nan)


def check_window_mass(mass, q_seq, q_pos, heads, window):
    """One unit per row and head, all of it inside that row's window."""
    per_seq = torch.bincount(q_seq.long().cpu(), minlength=mass.shape[0]).double() * heads
    torch.testing.assert_close(mass.double().cpu().sum(1), per_seq, rtol=1e-5, atol=1e-5)
    seen = torch.zeros(mass.shape, dtype=torch.bool)
    for b, p in zip(q_seq.tolist(), q_pos.tolist()):
        seen[b, max(0, p - window + 1) : p + 1] = True
    assert float(mass.cpu()[~seen].abs().sum()) == 0.0


WINDOW_CASES = CASES + [([9000, 700], 4, 2, 16, 16, 0.0005)]  # long context (windows 512 / 9000 keys)


@pytest.mark.parametrize("window", [1, 3, 512])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: f"lens{c[0]}-H{c[1]}-Hkv{c[2]}-D{c[3]}-bs{c[4]}")
def test_reference_window_matches_naive_f64(case, dtype, window):
    lens, heads, kv_heads, head_dim, block_size, fraction = case
    q_all, k_slab, v_slab, tables, ctx = make_cache(lens, heads, kv_heads, head_dim, block_size, dtype, seed=len(lens))
    rows, q_seq, q_pos = pick_rows(lens, fraction, seed=heads)
    if lens[0] == 9000:  # a few chosen rows: the last, one just inside the first window, the first
        q_seq = torch.tensor([0, 0, 0, 0, 1], dtype=torch.int32)
        q_pos = torch.tensor([8999, 5000, 511, 0, 699])
        rows = q_pos + torch.tensor([0, 0, 0, 0, 9000])
    k_slab, v_slab = poison_outside_windows(k_slab, v_slab, tables, q_seq, q_pos, block_size, window)
    q = q_all[rows]
    scale = head_dim**-0.5
    max_ctx = tables.shape[1] * block_size
    out, mass = scattered_rows_attention_reference(
        q, q_seq, q_pos, k_slab, v_slab, tables, ctx, block_size, scale, True, window
    )
    exp_out, exp_mass = naive_f64(q, q_seq, q_pos, k_slab, v_slab, tables, block_size, scale, max_ctx, window)
    assert out.dtype == dtype and out.shape == q.shape and out.isfinite().all()
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), exp_out, rtol=tol, atol=tol)
    torch.testing.assert_close(mass.double(), exp_mass, rtol=1e-5, atol=1e-5)
    check_window_mass(mass, q_seq, q_pos, heads, window)
    # The public wrapper (the compiled CPU kernel when built) gives the same answer.
    wrapped_out, wrapped_mass = scattered_rows_attention(
        q, q_seq, q_pos, k_slab, v_slab, tables, ctx, block_size, scale, True, window
    )
    torch.testing.assert_close(wrapped_out.double(), exp_out, rtol=tol, atol=max(tol, 1e-5))
    torch.testing.assert_close(wrapped_mass.double(), exp_mass, rtol=1e-4, atol=1e-5)


def test_reference_window_past_context_is_full_attention():
    """A window covering every row's keys (the longest row sees 21) is bitwise window=0; one key less is not."""
    q_all, k_slab, v_slab, tables, ctx = make_cache([21, 13], 6, 3, 16, 4, torch.float32, seed=2)
    q_seq = torch.tensor([0, 0, 1], dtype=torch.int32)
    q_pos = torch.tensor([20, 7, 12])
    args = (q_all[[20, 7, 33]], q_seq, q_pos, k_slab, v_slab, tables, ctx, 4, 0.25, True)
    full = scattered_rows_attention_reference(*args)
    for window in (21, 22, 10**9):
        windowed = scattered_rows_attention_reference(*args, window)
        assert torch.equal(windowed[0], full[0]) and torch.equal(windowed[1], full[1])
    narrow_out, narrow_mass = scattered_rows_attention_reference(*args, 20)
    assert not torch.equal(narrow_out[0], full[0][0]) and torch.equal(narrow_out[1:], full[0][1:])
    # Key 0 keeps the mass of the row at 7 (7 - 0 < 20) and loses that of the row at 20.
    assert 0 < float(narrow_mass[0, 0]) < float(full[1][0, 0])


def test_reference_rejects_bad_window():
    q_all, k_slab, v_slab, tables, ctx = make_cache([5], 4, 2, 8, 4, torch.float32)
    args = (q_all[:1], torch.zeros(1, dtype=torch.int32), torch.tensor([1]), k_slab, v_slab, tables, ctx, 4, 1.0, False)
    with pytest.raises(ValueError, match=r"window must be >= 0 \(0 = no sliding window\), got -1"):
        scattered_rows_attention_reference(*args, -1)
    with pytest.raises(ValueError, match="window must be >= 0"):
        scattered_rows_attention(*args, -1)
    with pytest.raises(TypeError, match="window must be an int"):
        scattered_rows_attention_reference(*args, 1.5)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [1, 3, 512, 100_000])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "case",
    GPU_CASES + [([9000, 40], 16, 4, 128, 16, 0.002)],
    ids=lambda c: f"B{len(c[0])}-H{c[1]}-Hkv{c[2]}-D{c[3]}-bs{c[4]}",
)
def test_kernel_window_matches_reference(case, dtype, window):
    lens, heads, kv_heads, head_dim, block_size, fraction = case
    q_all, k_slab, v_slab, tables, ctx = make_cache(
        lens, heads, kv_heads, head_dim, block_size, dtype, device="cuda", seed=7
    )
    rows, q_seq, q_pos = pick_rows(lens, fraction, seed=8, device="cuda")
    k_slab, v_slab = poison_outside_windows(k_slab, v_slab, tables, q_seq, q_pos, block_size, window)
    q = q_all[rows]
    scale = head_dim**-0.5
    args = (q, q_seq, q_pos, k_slab, v_slab, tables, ctx, block_size, scale, True, window)
    out, mass = _kernel(*args)
    assert out.shape == q.shape and out.dtype == dtype and out.isfinite().all()
    exact_out, exact_mass = scattered_rows_attention_reference(
        q.cpu().float(),
        q_seq.cpu(),
        q_pos.cpu(),
        k_slab.cpu().float(),
        v_slab.cpu().float(),
        tables.cpu(),
        ctx.cpu(),
        block_size,
        scale,
        True,
        window,
    )
    # Exact answer on the same rounded inputs: fp32 sum noise, plus the output's rounding in bf16/fp16.
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (TOL[dtype], 1e-4)
    torch.testing.assert_close(out.float().cpu(), exact_out, rtol=rtol, atol=atol)
    torch.testing.assert_close(mass.cpu(), exact_mass, rtol=1e-4, atol=1e-4)
    check_window_mass(mass, q_seq.cpu(), q_pos.cpu(), heads, window)
    out2, none = _kernel(*args[:9], False, window)
    assert none.shape == (0,)
    assert_split_matches_unsplit(out2, out)


@pytest.mark.gpu
def test_kernel_rejects_bad_window_and_opchecks_window():
    q_all, k_slab, v_slab, tables, ctx = make_cache([11, 6], 4, 2, 32, 4, torch.float32, device="cuda", seed=5)
    rows, q_seq, q_pos = pick_rows([11, 6], 0.5, seed=6, device="cuda")
    args = (q_all[rows], q_seq, q_pos, torch.nan_to_num(k_slab), torch.nan_to_num(v_slab), tables, ctx, 4, 0.2, True)
    with pytest.raises(ValueError, match="window must be >= 0"):
        _kernel(*args, -1)
    for window in (1, 3):
        torch.library.opcheck(torch.ops.ridgefill.scattered_rows_attention.default, args + (window,))


# ---------------------------------------------------------------------------
# Split-KV (flash-decoding) on CUDA: long rows in launches with few blocks. The heuristic splits all of these
# (a handful of rows) on any large GPU; test_kernel_split_knob_modes reruns them forced on and off.


def mixed_rows(lens, spec, seed=0):
    """(q_all row indices, q_seq, q_pos) for a per-sequence spec: "decode" (the last position), ("prefill", n)
    (the last n positions), ("scatter", fraction) (a random subset, at least one row), or a list of positions."""
    gen = torch.Generator().manual_seed(seed)
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    seqs, poss = [], []
    for b, (n, what) in enumerate(zip(lens, spec)):
        if what == "decode":
            pos = [n - 1]
        elif isinstance(what, list):
            pos = what
        elif what[0] == "prefill":
            pos = list(range(n - what[1], n))
        else:
            pos = (torch.rand(n, generator=gen) < what[1]).nonzero().flatten().tolist() or [n // 2]
        seqs += [b] * len(pos)
        poss += pos
    rows = torch.tensor([offsets[b] + p for b, p in zip(seqs, poss)], dtype=torch.long)
    return (
        rows.cuda(),
        torch.tensor(seqs, dtype=torch.int32, device="cuda"),
        torch.tensor(poss, dtype=torch.int64, device="cuda"),
    )


SPLIT_CASES = [
    # (context lens, per-sequence rows, H, Hkv, D, block size)
    ([4097], ["decode"], 9, 3, 64, 16),  # SmolLM2-like, one long decode
    ([1, 255, 257, 4100], ["decode"] * 4, 32, 8, 128, 16),  # around one chunk; Llama-like
    (
        [4133, 1, 300, 2500, 513],
        ["decode", "decode", ("prefill", 48), ("scatter", 0.01), [0, 256, 512]],
        9,
        3,
        64,
        7,
    ),  # mixed batch, odd block size
    ([3001, 1000], ["decode", ("prefill", 5)], 20, 1, 80, 32),  # group 20: several head chunks
    ([1500, 777], ["decode", "decode"], 8, 2, 256, 16),  # D 256
    ([2049], [[2048, 1024, 1023, 255, 256, 257, 0]], 4, 4, 32, 16),  # MHA, rows of one sequence
]


@pytest.mark.gpu
@pytest.mark.parametrize("window", [0, 1, 300, 1000])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: f"lens{c[0]}-H{c[2]}-Hkv{c[3]}-D{c[4]}-bs{c[5]}")
def test_kernel_split_matches_reference(case, dtype, window):
    lens, spec, heads, kv_heads, head_dim, block_size = case
    q_all, k_slab, v_slab, tables, ctx = make_cache(
        lens, heads, kv_heads, head_dim, block_size, dtype, device="cuda", seed=11
    )
    rows, q_seq, q_pos = mixed_rows(lens, spec, seed=12)
    if window:
        k_slab, v_slab = poison_outside_windows(k_slab, v_slab, tables, q_seq, q_pos, block_size, window)
    q = q_all[rows]
    scale = head_dim**-0.5
    args = (q, q_seq, q_pos, k_slab, v_slab, tables, ctx, block_size, scale)
    out, none = _kernel(*args, False, window)
    assert none.shape == (0,) and out.shape == q.shape and out.dtype == dtype and out.isfinite().all()
    exact_out, _ = scattered_rows_attention_reference(
        q.cpu().float(),
        q_seq.cpu(),
        q_pos.cpu(),
        k_slab.cpu().float(),
        v_slab.cpu().float(),
        tables.cpu(),
        ctx.cpu(),
        block_size,
        scale,
        False,
        window,
    )
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (TOL[dtype], 1e-4)
    torch.testing.assert_close(out.float().cpu(), exact_out, rtol=rtol, atol=atol)
    # key_mass never splits: the same call with it is the unsplit kernel.
    unsplit, mass = _kernel(*args, True, window)
    assert_split_matches_unsplit(out, unsplit)
    check_window_mass(mass, q_seq.cpu(), q_pos.cpu(), heads, window or 10**9)
    longest = min(int(q_pos.max()) + 1, window or 10**9)
    if SPLIT_MODE == "1" and dtype == torch.float32 and longest > MIN_SPLIT_KEYS:
        assert not torch.equal(out, unsplit), "RIDGEFILL_CUDA_ATTN_SPLIT=1 but no row was split"
    # Deterministic: no atomics on the split path.
    assert torch.equal(_kernel(*args, False, window)[0], out)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [0, 700])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_split_graph_capture(dtype, window):
    """Captured once, replayed after q, q_pos and context_lens change in place (the split is sized from the
    block tables, never from the device's context lengths, so the graph stays valid)."""
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    capacity = [4100] * 4
    q_all, k_slab, v_slab, tables, ctx = make_cache(
        capacity, heads, kv_heads, head_dim, block_size, dtype, device="cuda", seed=13
    )
    scale = head_dim**-0.5
    q = q_all[:4].clone()
    q_seq = torch.arange(4, dtype=torch.int32, device="cuda")
    q_pos = (ctx - 1).long()
    args = (q, q_seq, q_pos, k_slab, v_slab, tables, ctx, block_size, scale, False, window)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graph's docs ask
        torch.ops.ridgefill.scattered_rows_attention(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = torch.ops.ridgefill.scattered_rows_attention(*args)
    gen = torch.Generator().manual_seed(14)
    for new_lens in ([4100, 2000, 600, 1], [3001, 17, 4100, 257], [1, 1, 1, 4099]):
        ctx.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q_pos.copy_(ctx - 1)
        q.copy_(torch.randn(q.shape, generator=gen).to(dtype))
        graph.replay()
        exact_out, _ = scattered_rows_attention_reference(
            q.cpu().float(),
            q_seq.cpu(),
            q_pos.cpu(),
            k_slab.cpu().float(),
            v_slab.cpu().float(),
            tables.cpu(),
            ctx.cpu(),
            block_size,
            scale,
            False,
            window,
        )
        rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (TOL[dtype], 1e-4)
        torch.testing.assert_close(out.float().cpu(), exact_out, rtol=rtol, atol=atol)
        eager, _ = torch.ops.ridgefill.scattered_rows_attention(*args)
        assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["0", "1"])
def test_kernel_split_knob_modes(mode):
    """Reruns this file's CUDA kernel tests with RIDGEFILL_CUDA_ATTN_SPLIT=mode (the kernel reads the knob once
    per process): split forced off (then split == unsplit bitwise) and forced on for every row longer than 256
    keys. In such a child run (the knob already set) this test has nothing to drive and passes."""
    if SPLIT_MODE is not None:
        return
    root = Path(__file__).resolve().parents[2]
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-x",
        "-p",
        "no:cacheprovider",
        "-m",
        "gpu",
        "-k",
        "kernel and not knob_modes",
        str(Path(__file__).resolve()),
    ]
    env = dict(os.environ, RIDGEFILL_CUDA_ATTN_SPLIT=mode)
    res = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=3600)
    assert res.returncode == 0, f"RIDGEFILL_CUDA_ATTN_SPLIT={mode}:\n{res.stdout[-8000:]}\n{res.stderr[-4000:]}"
    assert " passed" in res.stdout and " skipped" not in res.stdout, res.stdout[-2000:]
