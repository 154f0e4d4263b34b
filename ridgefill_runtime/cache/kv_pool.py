"""The paged KV cache's storage: one K and one V slab per attention layer, addressed by slot."""

from __future__ import annotations

from collections.abc import Iterable

import torch


class KVPool:
    def __init__(self, layers: int | Iterable[int], num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        """`layers`: the attention layers' indices (an int n means layers 0..n-1). k[i], v[i] are
        layer i's slabs; a layer without attention (a recurrent one) has none."""
        ids = range(layers) if isinstance(layers, int) else tuple(layers)
        shape = (num_slots, num_kv_heads, head_dim)
        # NOTE: empty, not zeros: a slot is always written before it is read, and a
        # GiB-sized memset would cost every start-up about a second.
        self.k = {i: torch.empty(shape, dtype=dtype, device=device) for i in ids}
        self.v = {i: torch.empty(shape, dtype=dtype, device=device) for i in ids}
        self.num_slots = num_slots

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(self.k)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [N, Hkv, D] at slots [N]."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [L, Hkv, D] gathered from slots [L]."""
        return self.k[layer].index_select(0, slots), self.v[layer].index_select(0, slots)

    def copy_blocks(self, pairs: list[tuple[int, int]], block_size: int) -> None:
        """Copy-on-write: every slab's slots of block `source` into block `copy`, per pair."""
        src = torch.cat([torch.arange(a * block_size, (a + 1) * block_size) for a, _ in pairs])
        dst = torch.cat([torch.arange(b * block_size, (b + 1) * block_size) for _, b in pairs])
        for slabs in (self.k, self.v):
            for t in slabs.values():
                t.index_copy_(0, dst.to(t.device), t.index_select(0, src.to(t.device)))

    def bytes_per_token(self) -> int:
        if not self.k:
            return 0
        k = next(iter(self.k.values()))
        return 2 * len(self.k) * k.shape[1] * k.shape[2] * k.element_size()


def slots_for(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Slots of positions [start, end) under a block table."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
