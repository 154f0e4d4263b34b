"""The one cache factory: a model's CacheSpec and a budget -> the pools its layers use and the
manager that hands their ids out. Every engine, offline driver and evaluation builds here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from . import int8_kv
from .block_manager import BlockManager
from .kv_layout import KVLayout, window_layout
from .kv_pool import KVPool
from .manager import CacheManager
from .snapshots import SnapshotTable
from .spec import CacheSpec
from .state_pool import StatePool
from .window_pages import WindowPages


@dataclass(frozen=True)
class CacheBudget:
    """How big to make the caches: KV blocks (explicit, or what fits in kv_cache_gib once the
    per-sequence states are set aside) and one state slot per sequence that may run at once."""

    block_size: int = 16
    num_blocks: int | None = None  # overrides kv_cache_gib
    kv_cache_gib: float = 1.0
    state_slots: int = 1
    max_positions: int = 4096  # a model with no attention still needs blocks to count positions
    history_rows: int = 0  # most rows one speculative verification runs (recurrent snapshots)
    # Sliding-window layers give their old pages back (kv_layout.py); a model without such
    # layers ignores it (cache.window_bounded; the prefix cache caches the pages let go).
    window_bounded: bool = False
    fill_split: int = 0  # RidgeFill's split when the fill may run: window groups are cut there
    kv_dtype: torch.dtype | None = None  # what the K/V slabs hold; None: the spec's (the model's) dtype
    scratch_slot: bool = False  # one K/V slot past the blocks for decode graphs' padding rows (KVPool)
    state_snapshots: int = 0  # recurrent-state snapshots for the prefix cache (cache/snapshots.py)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be positive, got {self.kv_cache_gib}")
        if self.state_slots <= 0:
            raise ValueError(f"state_slots must be positive, got {self.state_slots}")
        if self.max_positions <= 0:
            raise ValueError(f"max_positions must be positive, got {self.max_positions}")
        if self.state_snapshots < 0:
            raise ValueError(f"state_snapshots must be >= 0, got {self.state_snapshots}")

    @classmethod
    def for_tokens(cls, num_tokens: int, block_size: int = 16) -> CacheBudget:
        """Room for one sequence of `num_tokens` positions (the offline drivers)."""
        return cls(
            block_size=block_size,
            num_blocks=max(1, -(-num_tokens // block_size)),
            state_slots=1,
            max_positions=max(1, num_tokens),
        )


class HookRelay(Protocol):
    def hook(self, owner: str, method: str, fn: Callable[..., None]) -> Callable[..., None]:
        """fn, also told to whoever must repeat it (`owner`: "states" or "kv", the pool it calls)."""


def _direct(owner: str, method: str, fn: Callable[..., None]) -> Callable[..., None]:
    return fn


@dataclass(frozen=True)
class ModelCaches:
    """What build_caches made: the tensor pools (the runner and model use them) and their size."""

    spec: CacheSpec
    kv: KVPool  # K/V slabs of the attention layers, keyed by layer
    states: StatePool  # per-slot recurrent states and split-state stashes
    block_size: int
    num_blocks: int  # pool blocks (with a layout: pages of group_size layers each)
    layout: KVLayout | None = None

    @property
    def max_tokens(self) -> int:
        """The longest sequence the pool holds alone, every group keeping every position (a
        filled prefill does until its late sweep ends)."""
        per_block = 1 if self.layout is None else self.layout.num_groups
        return self.num_blocks // per_block * self.block_size

    def manager(
        self,
        prefix_caching: bool = False,
        lazy_late_pages: bool = False,
        snapshot_every: int = 0,
        relay: HookRelay | None = None,
    ) -> CacheManager:
        """A manager of these pools' ids; freeing a slot clears what the pools keep in it.
        lazy_late_pages: the runner defers the fill's sliding-window late writes (Runner's
        defer_windows), so those pages are taken when the late sweep comes near them.
        snapshot_every: a recurrent model's prefix cache snapshots its states every this many
        blocks (and at each prompt's last full block). relay: tensor parallelism's rank 0 wraps
        each pool hook so that the other ranks' pools do the same (parallel/relay.py)."""
        hook = relay.hook if relay is not None else _direct
        if prefix_caching and not self.spec.prefix_cacheable:
            raise ValueError("cache.prefix_caching: " + self.spec.why_not_prefix_cacheable())
        snapshots = None
        if prefix_caching and self.spec.snapshot_bytes():
            if not self.states.num_snapshots:
                raise ValueError(
                    "cache.prefix_caching on a model with per-sequence states (recurrent, RIPE ring) needs "
                    "state snapshots (state_snapshots > 0)"
                )
            snapshots = SnapshotTable(self.states.num_snapshots)
        blocks = BlockManager(self.num_blocks, self.block_size)
        map_pages = hook("kv", "map_pages", self.kv.map_pages)
        pages = None if self.layout is None else WindowPages(self.layout, blocks, map_pages, lazy_late_pages)
        return CacheManager(
            blocks,
            self.states.num_slots,
            self.spec.stash_bytes_per_row(),
            on_free_slot=hook("states", "free_slot", self.states.free_slot),
            on_stash_done=hook("states", "drop_stash", self.states.drop_stash),
            on_rollback=hook("states", "restore_row", self.states.restore_row),
            prefix_caching=prefix_caching,
            window_pages=pages,
            kv_bytes_per_block=self.kv.bytes_per_token() * self.block_size,
            snapshots=snapshots,
            snapshot_every=snapshot_every,
        )


def kv_pool_of(caches: ModelCaches | KVPool) -> KVPool:
    """The K/V pool inside the ModelCaches a model is handed (the runner and the driver hand
    nothing else). NOTE: a pool passes through: the dense family takes it out once per forward
    and hands the pool itself to each of its layers."""
    return caches.kv if isinstance(caches, ModelCaches) else caches


def check_kv_dtype(kv_dtype: torch.dtype | None, device: torch.device | str) -> None:
    """Refuse an int8 cache where a reader of its slabs cannot dequantize: the CUDA kernels (batched
    attention, decode graphs) read float slabs, and reading int8 as numbers would be silently wrong."""
    if kv_dtype == torch.int8 and torch.device(device).type != "cpu":
        raise ValueError(
            f'cache.kv_dtype = "int8" runs on the CPU only: the {torch.device(device).type} attention kernels '
            "read float K/V slabs and cannot dequantize int8 ones; use float16 or bfloat16 there"
        )


def kv_bytes_per_token(spec: CacheSpec, kv_dtype: torch.dtype | None = None) -> int:
    """K/V bytes per position with slabs of `kv_dtype` (None: the spec's); int8 adds a float32
    scale per 32 values of each (layer, K or V, KV head) row, as KVPool.bytes_per_token counts it."""
    full = spec.kv_bytes_per_token()
    kv_dtype = kv_dtype or spec.dtype
    values = full * kv_dtype.itemsize // spec.dtype.itemsize
    if kv_dtype != torch.int8 or spec.attention is None:
        return values
    head_rows = full // (spec.attention.head_dim * spec.dtype.itemsize)  # 2 x layers x Hkv
    return values + 4 * int8_kv.groups(spec.attention.head_dim) * head_rows


def build_caches(spec: CacheSpec, budget: CacheBudget, device: torch.device | str) -> ModelCaches:
    check_kv_dtype(budget.kv_dtype, device)
    layout = window_layout(spec, budget.block_size, budget.fill_split) if budget.window_bounded else None
    num_blocks = _num_blocks(spec, budget, layout)
    att = spec.attention
    heads, dim = (att.num_kv_heads, att.head_dim) if att is not None else (1, 1)
    kv = KVPool(
        spec.paged_keys,
        num_blocks * budget.block_size,
        heads,
        dim,
        budget.kv_dtype or spec.dtype,
        device,
        layout,
        read_dtype=spec.dtype,
        scratch_slot=budget.scratch_slot,
    )
    states = StatePool(spec, budget.state_slots, device, budget.history_rows, budget.state_snapshots)
    return ModelCaches(spec, kv, states, budget.block_size, num_blocks, layout)


def _num_blocks(spec: CacheSpec, budget: CacheBudget, layout: KVLayout | None = None) -> int:
    """Pool blocks. With a layout a block is a page of group_size layers, so the same memory
    (or an explicit num_blocks of whole-model blocks) makes num_groups times as many."""
    per_model_block = 1 if layout is None else layout.num_groups
    if budget.num_blocks is not None:
        return budget.num_blocks * per_model_block
    per_block = kv_bytes_per_token(spec, budget.kv_dtype) * budget.block_size
    if per_block == 0:  # NOTE: no attention: blocks only count positions, room for every slot at full length
        return budget.state_slots * -(-budget.max_positions // budget.block_size)
    room = int(budget.kv_cache_gib * 2**30) - spec.state_bytes_per_sequence() * budget.state_slots
    room -= spec.snapshot_bytes() * budget.state_snapshots
    return max(1, room // per_block) * per_model_block
