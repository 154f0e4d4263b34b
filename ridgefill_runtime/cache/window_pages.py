"""The pages of a model's sliding-window groups (kv_layout.py), as plain integers.

Every block a sequence's table gains takes one page per window group too; once no later row of
the sequence can see a block's positions in a group (they lie `window` or more positions behind
the lowest position it may still run), that page goes back to the pool. The KV pool hears of
each change through `on_map` (its page_of table), as the pools hear of freed state slots."""

from __future__ import annotations

from collections.abc import Callable

from .block_manager import BlockManager
from .kv_layout import KVLayout

MapHook = Callable[[int, list[int], list[int]], None]  # (group, blocks, pages; -1: none)


class WindowPages:
    def __init__(self, layout: KVLayout, blocks: BlockManager, on_map: MapHook, lazy_late: bool = False):
        """lazy_late: the fill writes a filled row's sliding-window late K/V only when a late row
        reaches it (fill/plan.py), so during a two-sweep prefill those groups take a block's page
        only when the late sweep comes near it (ensure())."""
        self.layout = layout
        self.blocks = blocks
        self._on_map = on_map
        self.lazy = tuple(
            g for g in range(1, layout.num_groups) if lazy_late and layout.late(g) and layout.groups[g][0] > 0
        )
        self.late_window = max((layout.groups[g][0] for g in self.lazy), default=0)
        self._pages: dict[int, list[int]] = {}  # block id -> its page in each window group (-1: gone)
        # id(table) -> per window group, how many of its first blocks trim() has let go (so a
        # step looks at its newly passed blocks only); dropped by forget()
        self._trimmed: dict[int, list[int]] = {}

    @property
    def per_block(self) -> int:
        """Pages a new block takes: its own (group 0's) and one per window group."""
        return self.layout.num_groups

    def attach(self, new_blocks: list[int], eager: bool = True) -> None:
        """Give each new block of a table a page in every window group (not eager: the lazy late
        groups give none yet)."""
        if not new_blocks:
            return
        for g in range(1, self.layout.num_groups):
            if not eager and g in self.lazy:
                for block in new_blocks:
                    self._pages.setdefault(block, []).append(-1)
                continue
            pages = self.blocks.take(len(new_blocks))
            for block, page in zip(new_blocks, pages):
                self._pages.setdefault(block, []).append(page)
            self._on_map(g, new_blocks, pages)

    def missing(self, table: list[int], lo: int, hi: int) -> int:
        """Pages the lazy groups lack for the blocks holding positions [lo, hi)."""
        return len(self._lacking(table, lo, hi))

    def ensure(self, table: list[int], lo: int, hi: int) -> None:
        """The lazy groups take pages for the blocks holding positions [lo, hi) that have none."""
        lacking = self._lacking(table, lo, hi)
        for g in self.lazy:
            blocks = [b for gl, b in lacking if gl == g]
            pages = self.blocks.take(len(blocks))
            for block, page in zip(blocks, pages):
                self._pages[block][g - 1] = page
            if blocks:
                self._on_map(g, blocks, pages)

    def _lacking(self, table: list[int], lo: int, hi: int) -> list[tuple[int, int]]:
        bs = self.layout.block_size
        blocks = table[max(0, lo) // bs : -(-hi // bs)]
        return [(g, b) for g in self.lazy for b in blocks if self._pages[b][g - 1] < 0]

    def release(self, blocks: list[int]) -> None:
        """Blocks leaving a table: their window pages still held go back."""
        held = [b for b in blocks if b in self._pages]
        for g in range(1, self.layout.num_groups):
            gone = [b for b in held if self._pages[b][g - 1] >= 0]
            self.blocks.put([self._pages[b][g - 1] for b in gone])
            if gone:
                self._on_map(g, gone, [-1] * len(gone))
        for b in held:
            del self._pages[b]

    def trim(self, table: list[int], reach: int, late_reach: int | None = None) -> int:
        """No row of table's sequence runs below position `reach` any more in the layers below
        the split (below `late_reach` above it; None: not yet known there): each window group
        gives back the pages of the blocks wholly behind its window. Returns the pages freed."""
        bs, freed = self.layout.block_size, 0
        done = self._trimmed.setdefault(id(table), [0] * (self.layout.num_groups - 1))
        for g in range(1, self.layout.num_groups):
            window = self.layout.groups[g][0]
            reach_g = late_reach if self.layout.late(g) else reach
            if reach_g is None or window == 0:  # NOTE: a global group (one per split side) keeps all
                continue
            behind = min(len(table), max(0, reach_g - window + 1) // bs)  # blocks no later row sees
            gone = [b for b in table[done[g - 1] : behind] if self._pages[b][g - 1] >= 0]
            done[g - 1] = max(done[g - 1], behind)
            if not gone:
                continue
            self.blocks.put([self._pages[b][g - 1] for b in gone])
            for b in gone:
                self._pages[b][g - 1] = -1
            self._on_map(g, gone, [-1] * len(gone))
            freed += len(gone)
        return freed

    def forget(self, table: list[int]) -> None:
        """The table is emptied (its sequence freed or preempted): no trim cursor left for it."""
        self._trimmed.pop(id(table), None)
