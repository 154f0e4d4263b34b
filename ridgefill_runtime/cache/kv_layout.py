"""Window-bounded K/V (vLLM's KV cache groups, in our terms): how the attention layers of a
model with sliding-window layers share one pool of equal-sized pages.

A sliding-window layer is never read more than `window` positions back, so the pages holding
its older positions can go back to the pool while the sequence runs on; a global layer keeps
every position. The layers are cut into groups of `group_size` layers of one window each, all
groups the same size, so that one page (block_size positions of group_size layers' K and V)
is the unit every group takes from the one pool: memory freed by a local group serves any
group of any sequence.

Group 0 is global and its pages are the block ids the scheduler sees (a sequence's block
table): they hold every position while the sequence lives. Each other group maps a block id to
a page of its own (kv_pool.KVPool.page_of, filled by window_pages.WindowPages) or to -1 once
the block has left its window. Layer j of every group shares slab j: a page belongs to one
group at a time, so two groups never write the same slot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .spec import AttentionCache, CacheSpec


@dataclass(frozen=True)
class KVLayout:
    """groups[g] = (window, layers); group 0 is global (window 0). `split`: RidgeFill's split layer
    when the groups were cut there (no group holds layers on both sides), else 0."""

    block_size: int
    groups: tuple[tuple[int, tuple[int, ...]], ...]
    split: int = 0

    def __post_init__(self) -> None:
        sizes = {len(layers) for _, layers in self.groups}
        if len(sizes) != 1:
            raise ValueError(f"KV groups must all hold the same number of layers, got {self.groups}")
        if not self.groups or self.groups[0][0] != 0:
            raise ValueError("KV group 0 must be a global one (its pages are the block ids)")

    @property
    def group_size(self) -> int:
        return len(self.groups[0][1])

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def windows(self) -> tuple[int, ...]:
        return tuple(w for w, _ in self.groups)

    def late(self, group: int) -> bool:
        """The group's layers lie above the split: the late sweep, not the rows' own order,
        decides when they are read."""
        return self.split > 0 and self.groups[group][1][0] >= self.split

    def place(self, layer: int) -> tuple[int, int]:
        """(group, index within the group) of an attention layer; the index names its slab."""
        for g, (_, layers) in enumerate(self.groups):
            if layer in layers:
                return g, layers.index(layer)
        raise KeyError(f"layer {layer} keeps no paged K/V")


def window_layout(spec: CacheSpec, block_size: int, split: int = 0) -> KVLayout | None:
    """The layout that lets sliding-window layers give back old pages; None when the model has
    none, has no global layer (its block ids would have nothing to hold on to), or keeps other
    kinds of cache (recurrent states, loop planes) beside its K/V. `split` > 0: RidgeFill runs
    with this split, so groups are cut there: the lower layers' pages can go as the lower sweep
    moves on, while the late layers' wait for the late sweep (cache/window_pages.py)."""
    if not spec.windowed or not all(isinstance(c, AttentionCache) for c in spec.layers):
        return None
    by_class: dict[tuple[int, bool], list[int]] = {}
    for i, c in enumerate(spec.layers):
        by_class.setdefault((c.window, split > 0 and i >= split), []).append(i)
    if not any(window == 0 for window, _ in by_class):
        return None
    size = math.gcd(*(len(layers) for layers in by_class.values()))
    groups = []
    for window, late in sorted(by_class):  # NOTE: window 0 first: group 0 is global
        layers = by_class[(window, late)]
        groups += [(window, tuple(layers[k : k + size])) for k in range(0, len(layers), size)]
    return KVLayout(block_size, tuple(groups), split)
