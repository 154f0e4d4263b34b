"""The paged KV cache's storage: one K and one V slab per attention layer, addressed by slot.

With a KVLayout (kv_layout.py) sliding-window layers take pages of their own: layer j of each
group shares slab j, and a slot the scheduler computes from a block table (a block id, as
group 0 numbers it) is turned into the group's page here, on every read and write, so no
caller above the pool needs to know which layer keeps what."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from . import int8_kv
from .kv_layout import KVLayout


class KVPool:
    def __init__(
        self,
        layers: int | Iterable[int],
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        layout: KVLayout | None = None,
        read_dtype: torch.dtype | None = None,
        scratch_slot: bool = False,
    ):
        """`layers`: the attention layers' indices (an int n means layers 0..n-1). k[i], v[i] are
        layer i's slabs; a layer without attention (a recurrent one) has none. With `layout`,
        num_slots counts the pool's pages times block_size, shared by every group. `dtype`: what
        the slabs hold; written K/V are rounded to it, read() hands them back as `read_dtype` (the
        model's; None: the same). torch.int8: each (slot, KV head) row is stored quantized with a
        float32 scale per 32 values in k_scale[i] / v_scale[i] [slots, Hkv, G] beside the slab (int8_kv.py). scratch_slot: one slot past the last block, which no block table
        names: the padding rows of a replayed decode graph (decode_graphs.py) write and read there
        and nowhere else (not with a layout)."""
        ids = range(layers) if isinstance(layers, int) else tuple(layers)
        shape = (num_slots, num_kv_heads, head_dim)
        scales = (num_kv_heads, int8_kv.groups(head_dim))  # an int8 slot's scales per KV head
        self.num_slots = num_slots
        self.layout = layout
        self.read_dtype = read_dtype or dtype
        # NOTE: empty, not zeros: a slot is always written before it is read, and a
        # GiB-sized memset would cost every start-up about a second.
        self.scratch_slot: int | None = num_slots if scratch_slot and layout is None else None
        self.quantized = dtype == torch.int8
        # k_scale / v_scale: the int8 slabs' scales, keyed like k / v (empty for a float cache)
        self.k_scale: dict[int, torch.Tensor] = {}
        self.v_scale: dict[int, torch.Tensor] = {}
        if layout is None:
            shape = (num_slots + (self.scratch_slot is not None), num_kv_heads, head_dim)
            self.k = {i: torch.empty(shape, dtype=dtype, device=device) for i in ids}
            self.v = {i: torch.empty(shape, dtype=dtype, device=device) for i in ids}
            if self.quantized:
                self.k_scale = {i: torch.empty((shape[0], *scales), device=device) for i in ids}  # [slots, Hkv, G]
                self.v_scale = {i: torch.empty((shape[0], *scales), device=device) for i in ids}
            return
        k_slabs = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layout.group_size)]
        v_slabs = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layout.group_size)]
        self.k = {i: k_slabs[layout.place(i)[1]] for i in ids}
        self.v = {i: v_slabs[layout.place(i)[1]] for i in ids}
        if self.quantized:  # NOTE: the scales are paged (and shared by a group's layers) as their slabs are
            k_scales = [torch.empty((shape[0], *scales), device=device) for _ in range(layout.group_size)]
            v_scales = [torch.empty((shape[0], *scales), device=device) for _ in range(layout.group_size)]
            self.k_scale = {i: k_scales[layout.place(i)[1]] for i in ids}
            self.v_scale = {i: v_scales[layout.place(i)[1]] for i in ids}
        self._group = {i: layout.place(i)[0] for i in ids}
        num_pages = num_slots // layout.block_size
        # page_of[g, block]: the page group g keeps block's positions in, -1 while it has none;
        # group 0's pages are the block ids themselves.
        self.page_of = torch.full((layout.num_groups, num_pages), -1, dtype=torch.int64, device=device)
        self.page_of[0] = torch.arange(num_pages, device=device)
        self._paged_for: torch.Tensor | None = None  # the step's block tables block_tables() last saw
        self._paged: tuple[torch.Tensor, ...] = ()  # per group: those tables, paged as the group is
        self._physical_for: torch.Tensor | None = None  # the slots physical() last saw
        self._physical: tuple[torch.Tensor, ...] = ()  # per group: those slots in the group's pages

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(self.k)

    def map_pages(self, group: int, blocks: list[int], pages: list[int]) -> None:
        """Group `group` keeps blocks[i]'s positions in pages[i] (-1: in none any more)."""
        self._paged_for = self._physical_for = None  # NOTE: tables and slots paged before this are stale
        at = torch.tensor(blocks, dtype=torch.int64)
        self.page_of[group].index_copy_(
            0, at.to(self.page_of.device), torch.tensor(pages, dtype=torch.int64, device=self.page_of.device)
        )

    def physical(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The slab slots [N] of block-table slots [N] at `layer`.
        NOTE: a step's layers all write the same slots tensor: every group's are made at once, on the
        first call (four ops a layer otherwise, ~0.3 ms of a Gemma 3 batch-1 decode step)."""
        if self.layout is None or self._group[layer] == 0:
            return slots
        if self._physical_for is not slots:
            bs = self.layout.block_size
            self._physical_for = slots
            self._physical = (self.page_of[:, slots // bs] * bs + slots % bs).unbind(0)  # G x [N]
        return self._physical[self._group[layer]]

    def block_tables(self, layer: int, tables: torch.Tensor) -> torch.Tensor:
        """int32 [B, max_blocks] tables as `layer`'s slab is paged (-1: a page let go).
        NOTE: every layer of a step passes the same tables: every group's are made at once."""
        if self.layout is None or self._group[layer] == 0:
            return tables
        if self._paged_for is not tables:
            self._paged_for = tables
            self._paged = self.page_of[:, tables.long()].to(torch.int32).unbind(0)  # G x [B, max_blocks]
        return self._paged[self._group[layer]]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [N, Hkv, D] at slots [N]."""
        at = self.physical(layer, slots)
        if self.quantized:
            int8_kv.write(self.k[layer], self.v[layer], self.k_scale[layer], self.v_scale[layer], at, k, v)
            return
        k_slab, v_slab = self.k[layer], self.v[layer]
        # NOTE: .to only where the dtypes differ: even a no-op .to costs ~1 us, twice a layer at decode
        k_slab.index_copy_(0, at, k if k.dtype == k_slab.dtype else k.to(k_slab.dtype))
        v_slab.index_copy_(0, at, v if v.dtype == v_slab.dtype else v.to(v_slab.dtype))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [L, Hkv, D] gathered from slots [L]."""
        at = self.physical(layer, slots)
        k, v = self.k[layer].index_select(0, at), self.v[layer].index_select(0, at)
        if self.quantized:
            k_s, v_s = self.k_scale[layer].index_select(0, at), self.v_scale[layer].index_select(0, at)  # [L, Hkv, G]
            return int8_kv.dequantize(k, k_s, self.read_dtype), int8_kv.dequantize(v, v_s, self.read_dtype)
        return k.to(self.read_dtype), v.to(self.read_dtype)

    def copy_from(
        self, layer: int, slots: torch.Tensor, src: KVPool, src_slots: torch.Tensor, parts=("k", "v")
    ) -> None:
        """Put `src`'s stored keys and/or values (`parts`) of `layer` at src_slots [N] into slots [N],
        as stored: an int8 cache's rows with their scales, nothing rounded twice (evaluation's splices)."""
        to, at = self.physical(layer, slots), src.physical(layer, src_slots)
        for part in parts:
            getattr(self, part)[layer][to] = getattr(src, part)[layer][at]
            if self.quantized:
                getattr(self, part + "_scale")[layer][to] = getattr(src, part + "_scale")[layer][at]

    def scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """The int8 slabs' scales [slots, Hkv, G] of `layer` (None, None for a float cache)."""
        if not self.quantized:
            return None, None
        return self.k_scale[layer], self.v_scale[layer]

    def scale_slots(self, layer: int, slots: torch.Tensor, ratio: torch.Tensor, keys: bool) -> None:
        """Multiply the values (keys: the keys) of `layer` at slab slots [P] by ratio [Hkv] per
        KV head (the fill's rescale). An int8 cache scales the rows' scales: the same product,
        with no second rounding of the stored values."""
        slab = (self.k if keys else self.v)[layer]
        if self.quantized:
            slab = (self.k_scale if keys else self.v_scale)[layer]  # [slots, Hkv, G]
            slab.index_copy_(0, slots, slab.index_select(0, slots) * ratio.float()[None, :, None])
            return
        rows = slab.index_select(0, slots)  # [P, Hkv, D]
        slab.index_copy_(0, slots, rows * ratio.to(slab.dtype)[None, :, None])

    def copy_blocks(self, pairs: list[tuple[int, int]], block_size: int) -> None:
        """Copy-on-write: every slab's slots of block `source` into block `copy`, per pair."""
        if self.layout is not None:
            raise RuntimeError("copy-on-write needs the prefix cache, which window-bounded K/V runs without")
        src = torch.cat([torch.arange(a * block_size, (a + 1) * block_size) for a, _ in pairs])
        dst = torch.cat([torch.arange(b * block_size, (b + 1) * block_size) for _, b in pairs])
        for slabs in (self.k, self.v, self.k_scale, self.v_scale):  # (the scales are empty unless int8)
            for t in slabs.values():
                t.index_copy_(0, dst.to(t.device), t.index_select(0, src.to(t.device)))

    def bytes_per_token(self) -> int:
        """What the slabs (and an int8 cache's scales) take per slot, all layers together."""
        slabs = {id(t): t for t in self.k.values()}
        if not slabs:
            return 0
        k = next(iter(slabs.values()))
        scales = 4 * int8_kv.groups(k.shape[2]) if self.quantized else 0  # float32 scales per 32 values
        per_head = k.shape[2] * k.element_size() + scales
        return 2 * len(slabs) * k.shape[1] * per_head
