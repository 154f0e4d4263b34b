"""The slot function and the step-layout builder against naive, row-by-row references.

The references never use the slot formula: a sequence's slots are its blocks' slot ranges laid
end to end (position p is the p-th of them), and each row's view of the step (its sequence, its
position, the cache slots of the keys it sees) is written out row by row."""

from __future__ import annotations

import pytest
import torch

from ridgefill_runtime.layers.attention import compiled_for, kv_slots
from ridgefill_runtime.step_layout import SeqLayout, attention_batch, padded_block_tables

BLOCK = 4


def _slots_by_walking(table: list[int], n: int, block_size: int) -> list[int]:
    """The first n slots of a sequence: block table[0]'s slots in order, then table[1]'s, ..."""
    laid = [b * block_size + offset for b in table for offset in range(block_size)]
    return laid[:n]


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_kv_slots_walks_the_block_table(block_size):
    g = torch.Generator().manual_seed(block_size)
    table = torch.randperm(40, generator=g)[:9].tolist()
    n = 9 * block_size
    walked = _slots_by_walking(table, n, block_size)
    every = kv_slots(torch.tensor(table), torch.arange(n), block_size)
    assert every.tolist() == walked
    scattered = torch.tensor([n - 1, 0, block_size, 2 * block_size - 1, n // 2])
    assert kv_slots(torch.tensor(table), scattered, block_size).tolist() == [walked[p] for p in scattered.tolist()]


# Per sequence: (context before the step, rows this step, scattered positions or None, kind)
STEP = [
    (0, 5, None, "fresh"),  # a fresh prompt: every key is this step's
    (11, 1, None, "table"),  # a decode row
    (6, 3, None, "table"),  # a chunk continuing a cached context
    (14, 0, [2, 7, 13], "table"),  # scattered exact rows over their prefix
    (12, 0, [3, 9], "chosen"),  # the fill's late rows over chosen keys (their slots given)
]


def _tables():
    g = torch.Generator().manual_seed(7)
    free = torch.randperm(64, generator=g).tolist()
    return [[free.pop() for _ in range(-(-max(c + n, 1) // BLOCK))] for c, n, _, _ in STEP]


def _layouts(tables):
    """The step as the builder is handed it: per sequence its layout, and every row's write slot."""
    seqs, write = [], []
    for i, ((ctx, n, scattered, kind), table) in enumerate(zip(STEP, tables)):
        every = _slots_by_walking(table, len(table) * BLOCK, BLOCK)
        pos = list(range(ctx, ctx + n)) if scattered is None else scattered
        write.extend(every[p] for p in pos)
        query_pos = None if scattered is None else torch.tensor(scattered)
        common = dict(rows=len(pos), query_pos=query_pos, state_slot=10 + i, verifies=i == 2)
        if kind == "chosen":
            keys = [0, 1, 3, 8, 9, 11]
            common.update(read_slots=torch.tensor([every[p] for p in keys]), key_pos=torch.tensor(keys))
            seqs.append(SeqLayout(context_len=len(keys), fresh=False, **common))
        else:
            end = ctx + n if scattered is None else ctx
            seqs.append(SeqLayout(context_len=end, read_table=table if kind == "table" else None, **common))
    return seqs, torch.tensor(write)


def _rows_by_hand(tables):
    """Each row of the step in order: (sequence, position, slots of the cache keys it sees by
    position, or None where its keys are this step's rows)."""
    rows = []
    for i, ((ctx, n, scattered, kind), table) in enumerate(zip(STEP, tables)):
        every = _slots_by_walking(table, len(table) * BLOCK, BLOCK)
        for p in range(ctx, ctx + n) if scattered is None else scattered:
            if kind == "fresh":
                seen = None
            elif kind == "chosen":
                seen = [every[k] for k in (0, 1, 3, 8, 9, 11) if k <= p]
            else:
                seen = every[: p + 1]
            rows.append((i, p, seen))
    return rows


def _rows_of(batch):
    """The same per-row view, read off an AttentionBatch."""
    rows = []
    for i in range(batch.num_seqs):
        slots, keys = batch.read_slots[i], None
        if slots is not None:
            chosen = batch.key_pos is not None and batch.key_pos[i] is not None
            keys = batch.key_pos[i] if chosen else torch.arange(len(slots))  # the keys' positions
        for p in batch.row_positions(i, "cpu").tolist():
            seen = None if slots is None else slots[keys <= p].tolist()
            rows.append((i, p, seen))
    return rows


def test_builder_lays_out_every_row_as_a_naive_construction():
    tables = _tables()
    seqs, write = _layouts(tables)
    batch = attention_batch(seqs, write, block_size=BLOCK, device="cpu", block_tables=padded_block_tables(tables))
    want = _rows_by_hand(tables)
    assert _rows_of(batch) == want
    owners = [i for i, _, _ in want]
    assert [i for i in range(batch.num_seqs) for _ in range(batch.query_starts[i], batch.query_starts[i + 1])] == owners
    assert batch.query_starts[-1] == len(want) == write.shape[0]
    assert [batch.reads_cache(i) for i in range(batch.num_seqs)] == [kind != "fresh" for *_, kind in STEP]
    assert batch.state_slots == [10, 11, 12, 13, 14]
    # NOTE: rows from position 0 start a fresh state, the late rows over chosen keys were told not to
    assert batch.state_fresh == [True, False, False, False, False]
    assert batch.verifies == [False, False, True, False, False]
    assert batch.block_tables.tolist() == [t + [0] * (max(map(len, tables)) - len(t)) for t in tables]
    if compiled_for(torch.device("cpu")):  # the batched kernel's rows: each row's sequence and position
        paged = batch.paged
        assert paged.owner.tolist() == owners
        assert paged.pos.tolist() == [p for _, p, _ in want]
        assert paged.served_seqs == (False, True, True, True, False)  # not the fresh prompt, not chosen keys


def test_a_layout_that_says_nothing_leaves_the_lists_out():
    """No scattered row, no state, no draft, no fresh flag: the batch's lists are None, as the
    layers read them."""
    batch = attention_batch([SeqLayout(rows=1, context_len=1)] * 3, torch.zeros(3, dtype=torch.int64))
    assert batch.query_starts == [0, 1, 2, 3] and batch.context_lens == [1, 1, 1]
    assert batch.query_pos is batch.key_pos is batch.state_slots is batch.state_fresh is batch.verifies is None
    assert not any(batch.reads_cache(i) for i in range(3)) and list(batch.read_slots) == [None] * 3


def test_read_slots_through_the_table_are_made_only_when_asked():
    tables = _tables()
    seqs, write = _layouts(tables)
    batch = attention_batch(seqs, write, block_size=BLOCK, device="cpu")
    assert batch.read_slots._made.keys() == {4}  # only the given slots, before any layer asks
    assert batch.read_slots[1].tolist() == _slots_by_walking(tables[1], 12, BLOCK)
    assert batch.read_slots._made.keys() == {1, 4}


@pytest.mark.parametrize(
    "fields",
    [
        dict(rows=3, context_len=2),  # more last rows than positions
        dict(rows=2, context_len=5, query_pos=torch.tensor([1])),  # a position per row
        dict(rows=1, context_len=5, read_table=[0], read_slots=torch.arange(5)),  # one source of keys
        dict(rows=1, context_len=5, key_pos=torch.arange(5)),  # key positions without their slots
        dict(rows=1, context_len=3, read_slots=torch.arange(3), key_pos=torch.arange(2)),
    ],
)
def test_an_inconsistent_layout_is_refused(fields):
    with pytest.raises(ValueError):
        SeqLayout(**fields)


def test_a_table_read_needs_the_block_size_and_device():
    seq = SeqLayout(rows=1, context_len=3, read_table=[2])
    with pytest.raises(ValueError):
        attention_batch([seq], torch.zeros(1, dtype=torch.int64), device="cpu")
    with pytest.raises(ValueError):
        attention_batch([seq], torch.zeros(1, dtype=torch.int64), block_size=BLOCK)
