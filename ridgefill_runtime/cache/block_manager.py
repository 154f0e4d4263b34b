"""Block bookkeeping for the paged KV cache: plain integers, no tensors.

The scheduler owns this. A sequence's block table lists the block ids that hold its
positions in order; position p lives in slot `table[p // block_size] * block_size + p % block_size`.

Prefix caching: a full block whose K/V are final may be published under a key (prefix_cache.py
makes them: a hash of everything its K/V depend on). Tables that hold the same block share it
by reference count. A block nobody holds but that still has a key stays readable as a cache
entry until it is needed: free blocks are handed out clean ones first, then cached ones least
recently used first, which is when their key is forgotten.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        # NOTE: a stack, so recently freed (cache-warm) blocks are reused first.
        self._clean: list[int] = list(range(num_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()  # free blocks with a key, least recent first
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._exact: dict[int, tuple[int, ...]] = {}  # published block -> offsets of its exactly made rows
        self.evictions = 0
        # NOTE: the pool's slabs are torch.empty, so a block costs resident memory only from its
        # first write on; the soak subtracts what the blocks ever taken hold from the RSS.
        self._touched = bytearray(num_blocks)
        self.num_touched = 0  # distinct blocks ever handed out

    @property
    def num_free(self) -> int:
        """Blocks a table may take now: clean ones and cache entries nobody holds."""
        return len(self._clean) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Blocks published under a key (held or not)."""
        return len(self._key_of)

    def blocks_needed(self, table: list[int], num_tokens: int) -> int:
        """Extra blocks a table must gain to hold `num_tokens` positions in all."""
        want = -(-num_tokens // self.block_size)
        return max(0, want - len(table))

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Append blocks to `table` (in place) so it covers `num_tokens` positions."""
        need = self.blocks_needed(table, num_tokens)
        if need > self.num_free:
            raise RuntimeError(f"KV cache out of blocks: need {need}, {self.num_free} free")
        for _ in range(need):
            block = self._take_free()
            self._refs[block] = 1
            table.append(block)

    def shrink(self, table: list[int], num_tokens: int) -> None:
        """Let go of the blocks of `table` past those holding `num_tokens` positions (in place)."""
        keep = -(-num_tokens // self.block_size)
        if keep < len(table):
            self._release(table[keep:])
            del table[keep:]

    def free(self, table: list[int]) -> None:
        """Let go of every block of `table` and empty it."""
        self._release(table)
        table.clear()

    def take(self, n: int) -> list[int]:
        """n blocks held by no table (a window group's pages, window_pages.py)."""
        if n > self.num_free:
            raise RuntimeError(f"KV cache out of blocks: need {n}, {self.num_free} free")
        taken = [self._take_free() for _ in range(n)]
        for block in taken:
            self._refs[block] = 1
        return taken

    def put(self, blocks: list[int]) -> None:
        """Give back blocks from take()."""
        self._release(blocks)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    # -- prefix caching -----------------------------------------------------------------------

    def lookup(self, key: bytes) -> int | None:
        """The block published under `key`, held or not; None when there is none."""
        return self._block_of.get(key)

    def is_free(self, block: int) -> bool:
        return self._refs[block] == 0

    def share(self, table: list[int], block: int) -> None:
        """Append a published block to `table`, which now holds it too."""
        if block not in self._key_of:
            raise RuntimeError(f"block {block} is not published: only cache entries are shared")
        self.hold(block)
        table.append(block)

    def hold(self, block: int) -> None:
        """One more reference on a block that is held or a cache entry (which then stops being
        free); put() gives it back."""
        if self._refs[block] == 0:
            if block not in self._cached:
                raise RuntimeError(f"block {block} is free and no cache entry: take() it instead")
            del self._cached[block]
        self._refs[block] += 1

    def key_of(self, block: int) -> bytes:
        return self._key_of[block]

    def exact_offsets(self, block: int) -> tuple[int, ...]:
        """Offsets of the rows of a published block whose late K/V were made exactly."""
        return self._exact[block]

    def publish(self, block: int, key: bytes, exact: tuple[int, ...]) -> bool:
        """Make a held block's K/V findable under `key`; `exact`: the offsets of its rows made
        exactly. False (nothing changes) when the block already has a key or another block
        holds this one (the first stays the entry)."""
        if self._refs[block] == 0:
            raise RuntimeError(f"block {block} is free: only a held block's K/V can be published")
        if block in self._key_of or key in self._block_of:
            return False
        self._key_of[block], self._block_of[key], self._exact[block] = key, block, exact
        return True

    def num_shared(self, table: list[int], indices: list[int]) -> int:
        """How many of table[i] other tables hold too."""
        return sum(self._refs[table[i]] > 1 for i in indices)

    def make_own(self, table: list[int], indices: list[int]) -> list[tuple[int, int]]:
        """Copy-on-write before table's holder rewrites rows of table[i], for each i: a block
        others hold too is replaced by a new block; so is one only it holds while room is left
        (the cache entry then stays for later requests), else that one stops being an entry.
        Returns the (old, new) pairs whose K/V the caller must copy.
        NOTE: every new block is taken before any old one is let go, so none is an old one."""
        pairs = []
        must = self.num_shared(table, indices)
        for i in indices:
            block = table[i]
            alone = self._refs[block] == 1
            if alone and (block not in self._key_of or self.num_free <= must):
                self._unpublish(block)
                continue
            must -= not alone
            new = self._take_free()
            self._refs[new] = 1
            pairs.append((block, new))
            table[i] = new
        self._release([old for old, _ in pairs])
        return pairs

    def _unpublish(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key], self._exact[block]

    def _take_free(self) -> int:
        if self._clean:
            block = self._clean.pop()
            if not self._touched[block]:
                self._touched[block] = 1
                self.num_touched += 1
            return block
        block, _ = self._cached.popitem(last=False)  # NOTE: the least recently used entry goes
        self._unpublish(block)
        self.evictions += 1
        return block

    def _release(self, blocks: list[int]) -> None:
        # NOTE: the last block first, so a table's later blocks are the earlier evicted: a cached
        # prefix is only of use from its first block on.
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] < 0:
                raise RuntimeError(f"block {block} released more often than it was taken")
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._cached[block] = None
                else:
                    self._clean.append(block)
