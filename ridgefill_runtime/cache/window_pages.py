"""The pages of a model's sliding-window groups (kv_layout.py), as plain integers.

Every block a sequence's table gains takes one page per window group too; once no later row of
the sequence can see a block's positions in a group (they lie `window` or more positions behind
the lowest position it may still run), the table lets that page go. The KV pool hears of each
change through `on_map` (its page_of table), as the pools hear of freed state slots.

With the prefix cache, pages are shared like blocks: a page has one reference per table that
holds it (the BlockManager counts them), and a block's page in a group is the same for every
table holding it. A table holds the pages of its blocks from index first[g] on in group g: those
before it were let go (trim) or never taken (a prefix hit takes only the pages its next row
reads: every page of a global group, the last window's of a window group, the rule of vLLM's
hybrid KV cache manager). A published block's pages are published under keys derived from its
own (page_key), so a page let go stays a cache entry until the room is needed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from .block_manager import BlockManager
from .kv_layout import KVLayout

MapHook = Callable[[int, list[int], list[int]], None]  # (group, blocks, pages; -1: none)
PagePick = tuple[int, int, int]  # (group, index of the block in the hit, page)


def page_key(block_key: bytes, group: int) -> bytes:
    """The prefix-cache key of the page a published block keeps in window group `group`."""
    return hashlib.blake2b(block_key + b"|page|" + group.to_bytes(2, "little"), digest_size=16).digest()


class WindowPages:
    def __init__(self, layout: KVLayout, blocks: BlockManager, on_map: MapHook, lazy_late: bool = False):
        """lazy_late: the fill writes a filled row's sliding-window late K/V only when a late row
        reaches it (fill/plan.py), so during a two-sweep prefill those groups take a block's page
        only when the late sweep comes near it (ensure()). Only filled sequences have lazy pages,
        and they take no part in the prefix cache on a window layout (Engine.filled_uncached), so
        a shared block never lacks a page."""
        self.layout = layout
        self.blocks = blocks
        self._on_map = on_map
        self.lazy = tuple(
            g for g in range(1, layout.num_groups) if lazy_late and layout.late(g) and layout.groups[g][0] > 0
        )
        self.late_window = max((layout.groups[g][0] for g in self.lazy), default=0)
        self._pages: dict[int, list[int]] = {}  # block id -> its page in each window group (-1: none)
        # id(table) -> per window group, the first of its blocks whose page it holds (those
        # before: let go or never taken); dropped by forget()
        self._first: dict[int, list[int]] = {}

    @property
    def per_block(self) -> int:
        """Pages a new block takes: its own (group 0's) and one per window group."""
        return self.layout.num_groups

    def _groups(self) -> range:
        return range(1, self.layout.num_groups)

    def _cursor(self, table: list[int]) -> list[int]:
        return self._first.setdefault(id(table), [0] * (self.layout.num_groups - 1))

    def attach(self, new_blocks: list[int], eager: bool = True) -> None:
        """Give each new block of a table a page in every window group (not eager: the lazy late
        groups give none yet). NOTE: a block new to a table is held by no other, so neither are
        its pages: it has none yet."""
        if not new_blocks:
            return
        for block in new_blocks:
            self._pages[block] = [-1] * (self.layout.num_groups - 1)
        for g in self._groups():
            if not eager and g in self.lazy:
                continue
            pages = self.blocks.take(len(new_blocks))
            for block, page in zip(new_blocks, pages):
                self._pages[block][g - 1] = page
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

    def _let_go(self, g: int, blocks: list[int]) -> None:
        """One table lets go of these blocks' pages in group g. A page no table holds any more
        is unmapped (a published one stays a cache entry until the room is needed)."""
        pages = [self._pages[b][g - 1] for b in blocks]
        self.blocks.put(pages)
        gone = [b for b, page in zip(blocks, pages) if self.blocks.is_free(page)]
        for b in gone:
            self._pages[b][g - 1] = -1
        if gone:
            self._on_map(g, gone, [-1] * len(gone))

    def release(self, table: list[int], start: int = 0) -> None:
        """The table lets go of its blocks from index `start` on (its sequence freed, or rejected
        draft blocks): the pages it holds among them go back."""
        first = self._cursor(table)
        for g in self._groups():
            held = [b for b in table[max(start, first[g - 1]) :] if self._pages[b][g - 1] >= 0]
            if held:
                self._let_go(g, held)

    def trim(self, table: list[int], reach: int, late_reach: int | None = None) -> int:
        """No row of table's sequence runs below position `reach` any more in the layers below
        the split (below `late_reach` above it; None: not yet known there): each window group
        lets go of the pages of the blocks wholly behind its window. Returns the pages let go."""
        bs, let_go = self.layout.block_size, 0
        first = self._cursor(table)
        for g in self._groups():
            window = self.layout.groups[g][0]
            reach_g = late_reach if self.layout.late(g) else reach
            if reach_g is None or window == 0:  # NOTE: a global group (one per split side) keeps all
                continue
            behind = min(len(table), max(0, reach_g - window + 1) // bs)  # blocks no later row sees
            gone = [b for b in table[first[g - 1] : behind] if self._pages[b][g - 1] >= 0]
            first[g - 1] = max(first[g - 1], behind)
            if gone:
                self._let_go(g, gone)
                let_go += len(gone)
        return let_go

    def forget(self, table: list[int]) -> None:
        """The table is emptied (its sequence freed or preempted): no cursor left for it."""
        self._first.pop(id(table), None)

    # -- the prefix cache ---------------------------------------------------------------------

    def reads(self, num_blocks: int) -> list[int]:
        """Per window group, the first block a row at position num_blocks * block_size reads (a
        global group: the first of all)."""
        bs, at = self.layout.block_size, num_blocks * self.layout.block_size
        return [0 if w == 0 else min(num_blocks, max(0, at - w + 1) // bs) for w, _ in self.layout.groups[1:]]

    def publish(self, table: list[int], published: list[tuple[int, bytes]]) -> None:
        """Blocks of table became cache entries under these (index, key): the pages it holds of
        them become entries too, under page_key(key, group)."""
        first = self._cursor(table)
        for i, key in published:
            for g in self._groups():
                page = self._pages[table[i]][g - 1]
                if i >= first[g - 1] and page >= 0:
                    self.blocks.publish(page, page_key(key, g), ())

    def readable(self, blocks: tuple[int, ...]) -> tuple[int, tuple[PagePick, ...]]:
        """How many of a prefix hit's first `blocks` a sequence may start from: the pages each
        window group reads at the position after them must be held or still cached. Returns
        that count and the pages to take. NOTE: a page held by a table is the one its block
        maps to, which a cache entry of the same key may not be (an older copy): that is taken."""
        found: dict[tuple[int, int], int | None] = {}

        def page(g: int, i: int) -> int | None:
            if (g, i) not in found:
                mapped = self._pages.get(blocks[i], ())
                held = mapped[g - 1] if mapped and mapped[g - 1] >= 0 else None
                found[(g, i)] = (
                    held if held is not None else self.blocks.lookup(page_key(self.blocks.key_of(blocks[i]), g))
                )
            return found[(g, i)]

        top = len(blocks)
        for g in self._groups():  # NOTE: a global group reads every block: its first gap bounds the hit
            if self.layout.groups[g][0] == 0:
                top = next((i for i in range(top) if page(g, i) is None), top)
        for k in range(top, 0, -1):
            want = [(g, i) for g, lo in zip(self._groups(), self.reads(k)) for i in range(lo, k)]
            if all(page(g, i) is not None for g, i in want):
                return k, tuple((g, i, page(g, i)) for g, i in want)
        return 0, ()

    def adopt(self, table: list[int], picks: tuple[PagePick, ...], first: list[int]) -> None:
        """table starts with a prefix hit's blocks: it holds their pages in group g from first[g]
        on, which `picks` name (readable())."""
        self._first[id(table)] = list(first)
        for g, i, page in picks:
            block = table[i]
            mapped = self._pages.setdefault(block, [-1] * (self.layout.num_groups - 1))
            self.blocks.hold(page)
            if mapped[g - 1] != page:
                mapped[g - 1] = page
                self._on_map(g, [block], [page])
