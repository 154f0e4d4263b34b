"""The layer's attention over one mixed step (decode rows, prefill chunks short and long, a fresh
prompt, scattered exact rows; GQA; contexts 1..4K) equals a float64 loop over each sequence
alone, and a decode step's rows all go to one batched kernel call per layer."""

import pytest
import torch

from ridgefill_runtime.cache.kv_pool import KVPool
from ridgefill_runtime.layers import attention
from ridgefill_runtime.layers.attention import AttentionBatch, ContextSlots, paged_attention, paged_attention_rows
from ridgefill_runtime.ops.scattered_rows_attention import compiled_for

BLOCK = 16


def _float64_rows(q, q_pos, k, v, scale):
    """q [n, H, D] at positions q_pos over k/v [ctx, Hkv, D] (positions 0..ctx-1) -> [n, H*D]."""
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    out = torch.empty(q.shape[0], q.shape[1], q.shape[2], dtype=torch.float64)
    for r in range(q.shape[0]):
        n_keys = int(q_pos[r]) + 1
        for h in range(q.shape[1]):
            s = (kk[:n_keys, h] @ q[r, h].double()) * scale  # [n_keys]
            out[r, h] = torch.softmax(s, dim=0) @ vv[:n_keys, h]
    return out.reshape(q.shape[0], -1)


def _step(specs, heads, kv_heads, dim, seed=0, dtype=torch.float32):
    """specs: per sequence (context before the step, rows this step, scattered positions or
    None). Returns what the layer is handed plus every sequence's full K/V and row positions."""
    g = torch.Generator().manual_seed(seed)
    total_blocks = sum(-(-(c + n) // BLOCK) for c, n, _ in specs) + 2
    pool = KVPool(1, total_blocks * BLOCK, kv_heads, dim, dtype, "cpu")
    free = torch.randperm(total_blocks, generator=g).tolist()  # shuffled blocks
    tables, starts, write, q_rows, positions, full_kv = [], [0], [], [], [], []
    k_step, v_step = [], []
    for ctx, n, scattered in specs:
        end = ctx + n if scattered is None else ctx
        table = [free.pop() for _ in range(-(-max(end, 1) // BLOCK))]
        k = torch.randn(end, kv_heads, dim, generator=g).to(dtype)
        v = torch.randn(end, kv_heads, dim, generator=g).to(dtype)
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(end)], dtype=torch.int64)
        if scattered is None:  # the cache holds 0..ctx-1; this step writes ctx..ctx+n-1
            pool.write(0, slots[:ctx], k[:ctx], v[:ctx])
            write.append(slots[ctx:])
            k_step.append(k[ctx:])
            v_step.append(v[ctx:])
            positions.append(torch.arange(ctx, ctx + n))
        else:  # exact rows at chosen positions, their keys already in the cache (RidgeFill's rows)
            pool.write(0, slots, k, v)
            write.append(slots[torch.tensor(scattered)])
            k_step.append(k[torch.tensor(scattered)])
            v_step.append(v[torch.tensor(scattered)])
            positions.append(torch.tensor(scattered))
        tables.append(table)
        full_kv.append((k, v))
        q_rows.append(torch.randn(len(positions[-1]), heads, dim, generator=g).to(dtype))
        starts.append(starts[-1] + len(positions[-1]))
    ends = [c + n if s is None else c for c, n, s in specs]
    width = max(len(t) for t in tables)
    batch = AttentionBatch(
        query_starts=starts,
        context_lens=ends,
        write_slots=torch.cat(write),
        read_slots=ContextSlots(
            [None if c == 0 and s is None else t for (c, _, s), t in zip(specs, tables)], ends, BLOCK, "cpu"
        ),
        query_pos=[None if s is None else p for (_, _, s), p in zip(specs, positions)],
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        block_size=BLOCK,
    )
    return pool, batch, torch.cat(q_rows), torch.cat(k_step), torch.cat(v_step), full_kv, positions


MIXED = [
    (4095, 1, None),  # a decode row at the 4K end
    (0, 1, None),  # a one-token prompt (context 1)
    (700, 1, None),  # a decode row
    (300, 5, None),  # a short chunk continuing a cached context (a speculative verify)
    (0, 57, None),  # a fresh prompt: the SDPA path
    (129, 40, None),  # a long chunk: the gather + SDPA path on the CPU
    (333, 0, [0, 17, 100, 250, 332]),  # scattered exact rows over their whole prefix
    (2, 1, None),
]


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 2)])
def test_mixed_step_equals_each_sequence_in_float64(heads, kv_heads):
    dim, scale = 64, 64**-0.5
    pool, batch, q, k_new, v_new, full_kv, positions = _step(MIXED, heads, kv_heads, dim, seed=heads)
    got = paged_attention(q, k_new, v_new, pool, 0, batch, scale)  # [N, H*D]
    for i, ((k, v), pos) in enumerate(zip(full_kv, positions)):
        lo, hi = batch.query_starts[i], batch.query_starts[i + 1]
        want = _float64_rows(q[lo:hi], pos, k, v, scale)
        assert (got[lo:hi].double() - want).abs().max() < 2e-5, f"sequence {i} {MIXED[i]}"
    if compiled_for(torch.device("cpu")):
        served = batch.paged.served.tolist()
        assert served == [True, False, True, True, False, False, True, True]


def test_logit_rows_subset_equals_float64():
    heads, kv_heads, dim, scale = 9, 3, 64, 0.125
    pool, batch, q, k_new, v_new, full_kv, positions = _step(MIXED, heads, kv_heads, dim, seed=3)
    rows = torch.tensor([0, 1, 2, 6, 7, 60, 100, 104, 108, 110])  # some rows of most sequences
    got = paged_attention_rows(q[rows], rows, k_new, v_new, pool, 0, batch, scale)
    owner = torch.searchsorted(torch.tensor(batch.query_starts), rows, right=True) - 1
    for r, i in enumerate(owner.tolist()):
        k, v = full_kv[i]
        j = int(rows[r]) - batch.query_starts[i]
        want = _float64_rows(q[rows[r : r + 1]], positions[i][j : j + 1], k, v, scale)
        assert (got[r].double() - want[0]).abs().max() < 2e-5


def test_logit_rows_none_of_which_the_batched_kernel_serves():
    """A step whose logit rows all lie in long chunks (the gather + SDPA path) while a short chunk
    of another sequence is served by the kernel: the kernel gets no row (a 16-sequence decode
    benchmark hit this, 4K prompts in 1,024-row chunks)."""
    specs = [(129, 40, None), (300, 5, None), (0, 57, None)]
    pool, batch, q, k_new, v_new, full_kv, positions = _step(specs, 9, 3, 64, seed=7)
    rows = torch.tensor([39, 101])  # the long chunk's last row, the fresh prompt's last row
    got = paged_attention_rows(q[rows], rows, k_new, v_new, pool, 0, batch, 0.125)
    for r, (i, j) in enumerate(((0, 39), (2, 56))):
        k, v = full_kv[i]
        want = _float64_rows(q[rows[r : r + 1]], positions[i][j : j + 1], k, v, 0.125)
        assert (got[r].double() - want[0]).abs().max() < 2e-5


@pytest.mark.skipif(not compiled_for(torch.device("cpu")), reason="compiled extension not built")
def test_a_decode_step_is_one_kernel_call_per_layer(monkeypatch):
    calls = []
    real = attention.scattered_rows_attention
    monkeypatch.setattr(
        attention, "scattered_rows_attention", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k)
    )
    specs = [(c, 1, None) for c in (1, 15, 16, 17, 1000, 2047)]
    pool, batch, q, k_new, v_new, full_kv, positions = _step(specs, 9, 3, 64, seed=5)
    got = paged_attention(q, k_new, v_new, pool, 0, batch, 0.125)
    assert calls == [len(specs)]  # every row in one call
    assert batch.read_slots._made == {}  # and no per-position slot list was built
    for i, ((k, v), pos) in enumerate(zip(full_kv, positions)):
        assert (got[i].double() - _float64_rows(q[i : i + 1], pos, k, v, 0.125)[0]).abs().max() < 2e-5


def test_bfloat16_cache():
    pool, batch, q, k_new, v_new, full_kv, positions = _step(MIXED[:4], 9, 3, 64, seed=11, dtype=torch.bfloat16)
    got = paged_attention(q, k_new, v_new, pool, 0, batch, 0.125)
    for i, ((k, v), pos) in enumerate(zip(full_kv, positions)):
        lo, hi = batch.query_starts[i], batch.query_starts[i + 1]
        assert (got[lo:hi].double() - _float64_rows(q[lo:hi], pos, k, v, 0.125)).abs().max() < 2e-2
