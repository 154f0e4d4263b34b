"""The paged KV cache's storage: one K and one V slab per layer, addressed by slot."""

from __future__ import annotations

import torch


class KVPool:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_slots, num_kv_heads, head_dim)
        # NOTE: empty, not zeros: a slot is always written before it is read, and a
        # GiB-sized memset would cost every start-up about a second.
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [N, Hkv, D] at slots [N]."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [L, Hkv, D] gathered from slots [L]."""
        return self.k[layer].index_select(0, slots), self.v[layer].index_select(0, slots)

    def bytes_per_token(self) -> int:
        k = self.k[0]
        return 2 * len(self.k) * k.shape[1] * k.shape[2] * k.element_size()


def slots_for(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Slots of positions [start, end) under a block table."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
