"""The snapshot table (cache/snapshots.py), ids only: slots taken, published, given back and
evicted least recently used first; restores count and refresh an entry."""

from __future__ import annotations

import pytest

from ridgefill_runtime.cache.snapshots import SnapshotTable


def test_take_publish_lookup_and_lru_eviction():
    table = SnapshotTable(2)
    a, b = table.take(), table.take()
    assert {a, b} == {0, 1} and table.num_taken == 2
    assert table.take() is None  # both are being written this step
    table.publish(a, b"A")
    table.publish(b, b"B")
    assert table.lookup(b"A") == a and table.num_published == 2 and table.num_taken == 0
    assert table.restore(b"A") == a and table.restores == 1  # A is now the most recently used
    c = table.take()  # no free slot: B, the least recently used, goes
    assert c == b and table.lookup(b"B") is None and table.evictions == 1
    table.publish(c, b"C")
    assert table.lookup(b"A") == a and table.lookup(b"C") == c


def test_a_second_copy_of_a_key_and_an_unused_slot_go_back():
    table = SnapshotTable(3)
    first, second, unused = table.take(), table.take(), table.take()
    table.publish(first, b"K")
    table.publish(second, b"K")  # the first stays the entry
    table.give_back(unused)
    assert table.lookup(b"K") == first and table.num_published == 1 and table.num_taken == 0
    assert sorted(s for s in (table.take(), table.take())) == sorted((second, unused))
    with pytest.raises(KeyError):
        table.give_back(first)  # never taken this step
    with pytest.raises(ValueError, match="at least one slot"):
        SnapshotTable(0)
