"""Block bookkeeping for the paged KV cache: plain integers, no tensors.

The scheduler owns this. A sequence's block table lists the block ids that hold its
positions in order; position p lives in slot `table[p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        # NOTE: a stack, so recently freed (cache-warm) blocks are reused first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, table: list[int], num_tokens: int) -> int:
        """Extra blocks a table must gain to hold `num_tokens` positions in all."""
        want = -(-num_tokens // self.block_size)
        return max(0, want - len(table))

    def can_grow(self, table: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(table, num_tokens) <= self.num_free

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Append blocks to `table` (in place) so it covers `num_tokens` positions."""
        need = self.blocks_needed(table, num_tokens)
        if need > self.num_free:
            raise RuntimeError(f"KV cache out of blocks: need {need}, {self.num_free} free")
        for _ in range(need):
            table.append(self._free.pop())

    def shrink(self, table: list[int], num_tokens: int) -> None:
        """Return the blocks of `table` past those holding `num_tokens` positions (in place)."""
        keep = -(-num_tokens // self.block_size)
        if keep < len(table):
            self._free.extend(reversed(table[keep:]))
            del table[keep:]

    def free(self, table: list[int]) -> None:
        """Return every block of `table` to the pool and empty it."""
        self._free.extend(reversed(table))
        table.clear()

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks
