"""Which snapshot slots hold a recurrent model's states after which cached block, as plain ids.

A Gated DeltaNet layer sums its whole prefix up in one fixed-size state (conv history and S),
so cached K/V blocks alone cannot resume a hybrid: a hit also needs every recurrent layer's state
after its last block. The state pool (state_pool.py) keeps copies of those states in snapshot
slots; this table says which slot holds the states after the block with a given history key
(prefix_cache.history_key: it names every token and exact row up to that block's end).

A slot is taken for a step that ends on a snapshot boundary (the runner copies the states in
after the step), published under the block's key once that block is published, and evicted least
recently used first when a new one is needed. A slot's states stay valid as long as its key
stays in the table, whether or not the blocks are still cached: a hit needs both.
"""

from __future__ import annotations

from collections import OrderedDict


class SnapshotTable:
    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"a snapshot table needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # published, least recently used first
        self._taken: set[int] = set()  # written this step, not published yet
        self.evictions = 0
        self.restores = 0  # hits that started from a snapshot

    @property
    def num_published(self) -> int:
        return len(self._slot_of)

    def lookup(self, key: bytes) -> int | None:
        """The slot holding the states after the block keyed `key`, if any."""
        return self._slot_of.get(key)

    def restore(self, key: bytes) -> int:
        """A sequence starts from this snapshot: it becomes the most recently used."""
        self._slot_of.move_to_end(key)
        self.restores += 1
        return self._slot_of[key]

    def take(self) -> int | None:
        """A slot to write a new snapshot into: a free one, else the least recently used entry's;
        None when every slot is being written this step."""
        if self._free:
            slot = self._free.pop()
        elif self._slot_of:
            _, slot = self._slot_of.popitem(last=False)
            self.evictions += 1
        else:
            return None
        self._taken.add(slot)
        return slot

    def publish(self, slot: int, key: bytes) -> None:
        """The slot now holds the states after the block keyed `key` (a second copy of one key
        goes back: the first stays the entry)."""
        self._taken.remove(slot)
        if key in self._slot_of:
            self._free.append(slot)
        else:
            self._slot_of[key] = slot

    def give_back(self, slot: int) -> None:
        """A taken slot whose step did not end where it was meant to (its sequence finished or
        its block was not published): nothing valid in it."""
        self._taken.remove(slot)
        self._free.append(slot)

    @property
    def num_taken(self) -> int:
        return len(self._taken)
