"""What each sequence holds in every cache, as ids: KV blocks (its block table), a state slot
(its recurrent states and, during a two-sweep prefill, its split-state stash). The scheduler
owns this and calls it to allocate, grow, free and preempt; no tensors live here.

The pools that hold the tensors (kv_pool.py, state_pool.py) hear of a freed slot through the
callbacks given at construction, so whatever a sequence holds goes back the moment the
scheduler lets it go: a preempted sequence's stash does not wait with it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from collections.abc import Callable

from ..stages import Stage
from .block_manager import BlockManager
from .prefix_cache import NO_HIT, PrefixCache, PrefixHit
from .snapshot_plan import SnapshotPlan
from .snapshots import SnapshotTable
from .window_pages import WindowPages

SlotHook = Callable[[int], None]


def _ignore(slot: int) -> None:
    pass


@dataclass(frozen=True)
class CacheStats:
    """One reading of what the caches hold."""

    kv_blocks_used: int
    kv_blocks_total: int
    state_slots_used: int
    state_slots_total: int
    stash_rows: int  # split-state rows held by sequences in a two-sweep prefill
    stash_bytes: int  # what those rows take (the N x d part)
    prefix_cached_blocks: int = 0  # blocks published in the prefix cache (held or not)
    prefix_queried_tokens: int = 0  # prompt tokens admissions looked up
    prefix_hit_tokens: int = 0  # of those, found in the prefix cache
    prefix_window_cut_tokens: int = 0  # not found: cached blocks whose window pages were evicted
    prefix_state_cut_tokens: int = 0  # not found: cached blocks with no state snapshot after them
    prefix_evictions: int = 0  # cache entries dropped to make room
    kv_touched_bytes: int = 0  # K/V pool bytes of the blocks ever handed out (resident since)
    state_snapshots: int = 0  # recurrent-state snapshots findable in the prefix cache
    state_restores: int = 0  # admissions that resumed from one

    def __post_init__(self) -> None:
        if not 0 <= self.kv_blocks_used <= self.kv_blocks_total:
            raise ValueError(f"kv blocks used {self.kv_blocks_used} outside 0..{self.kv_blocks_total}")
        if not 0 <= self.state_slots_used <= self.state_slots_total:
            raise ValueError(f"state slots used {self.state_slots_used} outside 0..{self.state_slots_total}")
        if self.stash_rows < 0 or self.stash_bytes < 0:
            raise ValueError(f"stash accounting must be >= 0, got {self.stash_rows} rows, {self.stash_bytes} bytes")


class CacheManager:
    def __init__(
        self,
        blocks: BlockManager,
        num_state_slots: int,
        stash_bytes_per_row: int = 0,
        on_free_slot: SlotHook = _ignore,
        on_stash_done: SlotHook = _ignore,
        on_rollback: Callable[[int, int], None] = lambda slot, row: None,
        prefix_caching: bool = False,
        window_pages: WindowPages | None = None,
        kv_bytes_per_block: int = 0,
        snapshots: SnapshotTable | None = None,
        snapshot_every: int = 0,
    ):
        """window_pages: a sliding-window model's per-group pages (the blocks then count pages:
        each block of a table takes one per group, and window groups give theirs back as rows
        pass); None: one block holds every layer's K/V. kv_bytes_per_block: what one block (or
        page) holds in the K/V pool, for stats' kv_touched_bytes. snapshots: a recurrent model's
        prefix cache keeps its states after some cached blocks (every `snapshot_every` blocks and
        each prompt's last full block); a hit must end at one."""
        if num_state_slots <= 0:
            raise ValueError(f"num_state_slots must be positive, got {num_state_slots}")
        self.blocks = blocks
        self.num_state_slots = num_state_slots
        self.stash_bytes_per_row = stash_bytes_per_row
        self.kv_bytes_per_block = kv_bytes_per_block
        self._on_free_slot, self._on_stash_done, self._on_rollback = on_free_slot, on_stash_done, on_rollback
        # NOTE: a stack, like the blocks: the most recently freed slot is reused first.
        self._free_slots: list[int] = list(range(num_state_slots - 1, -1, -1))
        self._stash_rows: dict[int, int] = {}  # slot -> rows of its stash, while its prefill runs
        self.prefix = PrefixCache(blocks) if prefix_caching else None
        self.pages = window_pages
        self.snapshots = None if snapshots is None else SnapshotPlan(snapshots, blocks.block_size, snapshot_every)

    # -- asking ---------------------------------------------------------------------------

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def blocks_needed(self, seq, num_tokens: int) -> int:
        """Pool blocks seq must take to hold `num_tokens` positions in all (with window pages,
        one per group for each new block of its table)."""
        new = self.blocks.blocks_needed(seq.block_table, num_tokens)
        return new if self.pages is None else new * self.pages.per_block

    def match(self, seq, usable: Callable[[object, PrefixHit], PrefixHit] | None = None) -> PrefixHit:
        """The cached blocks seq's prompt may start from (none without prefix caching), as much
        of them as `usable(seq, hit)` leaves; with window pages, only as many as have the pages
        their next row reads still cached (with those pages)."""
        if self.prefix is None:
            return NO_HIT
        hit = self.prefix.match(seq)
        if usable is not None:
            hit = usable(seq, hit)
        if self.snapshots is not None and hit.blocks:
            return self.snapshots.resume_point(seq, hit)
        if self.pages is None or not hit.blocks:
            return hit
        if seq.prefix.reselect and seq.fill.boundary:
            # NOTE: reselect remakes late rows anywhere in the cached prefix; the window pages
            # around them are mostly let go, so it runs a fresh fill (what reselect equals)
            return replace(NO_HIT, waits=hit.waits)
        k, picks = self.pages.readable(hit.blocks)
        kept = hit.cut(k * self.blocks.block_size)
        return replace(kept, pages=picks, waits=hit.waits, window_cut=hit.num_tokens - kept.num_tokens)

    def snapshot_stop(self, seq) -> int | None:
        """Where seq's next prefill chunk must end for a state snapshot (snapshot_plan.py)."""
        return None if self.snapshots is None else self.snapshots.stop(seq)

    def plan_state(self, item) -> None:
        """Before a step runs: the snapshot a newly admitted item loads, and the one its states
        are copied into after the step (snapshot_plan.py)."""
        seq = item.seq
        if seq.prefix.restore is not None:
            item.restore, seq.prefix.restore = seq.prefix.restore, None
        if self.snapshots is not None:
            self.snapshots.plan(item)

    def publish_state(self, item) -> None:
        """After a step: a state snapshot it took becomes a cache entry."""
        if self.snapshots is not None:
            self.snapshots.publish(item)

    def can_allocate(self, seq, num_tokens: int, reserved_blocks: int = 0, hit: PrefixHit = NO_HIT) -> bool:
        """Whether seq could start holding `num_tokens` positions, its first ones from `hit`,
        with `reserved_blocks` kept back. A cache entry nobody holds counts as free, so taking
        it costs a free block like a new one."""
        slot_ok = seq.state_slot is not None or bool(self._free_slots)
        shared = len(hit.blocks) * (1 if self.pages is None else self.pages.per_block)
        cached = sum(map(self.blocks.is_free, hit.blocks)) + sum(self.blocks.is_free(p) for *_, p in hit.pages)
        need = self.blocks_needed(seq, num_tokens) - shared + cached
        return slot_ok and need <= self.blocks.num_free - reserved_blocks

    def can_run(self, item) -> bool:
        """Whether the pool holds what a scheduled item writes and reads: its blocks, and (a
        late-sweep item, with lazy late pages) the late window pages around its rows."""
        span = self._late_span(item)
        late = 0 if span is None else self.pages.missing(item.seq.block_table, *span)
        return self.blocks_needed(item.seq, item.end) + late <= self.blocks.num_free

    def prepare(self, item) -> None:
        """Take what can_run() counted."""
        self.grow(item.seq, item.end)
        span = self._late_span(item)
        if span is not None:
            self.pages.ensure(item.seq.block_table, *span)

    def _late_span(self, item) -> tuple[int, int] | None:
        """Positions [lo, hi) whose lazy late window pages a late-sweep item needs: its rows read
        (and a filled row they first reach writes) at most `window` positions before them."""
        if self.pages is None or not self.pages.lazy or not item.kind.queued:
            return None
        return min(item.positions) - self.pages.late_window + 1, max(item.positions) + 1

    # -- changing ---------------------------------------------------------------------------

    def allocate(self, seq, num_tokens: int, hit: PrefixHit = NO_HIT) -> None:
        """Admission: a state slot (and its stash, for a filled prefill) and blocks for
        `num_tokens`, the first ones those of `hit` (shared, not copied)."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} is admitted while it holds blocks")
        for block in hit.blocks:
            self.blocks.share(seq.block_table, block)
        if self.pages is not None:
            self.pages.adopt(seq.block_table, hit.pages, self.pages.reads(len(hit.blocks)))
        if self.snapshots is not None:
            seq.prefix.restore = self.snapshots.restore(hit)
        seq.prefix.block_keys = list(hit.keys)
        if self.prefix is not None:
            self.prefix.count(seq, hit)
            self.prefix.claim(seq, hit)
        if seq.state_slot is None:
            if not self._free_slots:
                raise RuntimeError(f"out of state slots: all {self.num_state_slots} are held")
            seq.state_slot = self._free_slots.pop()
        if not seq.fill.stage.done:  # NOTE: a two-sweep prefill keeps every row's split state
            self._stash_rows[seq.state_slot] = seq.num_tokens
        self.grow(seq, num_tokens)

    def grow(self, seq, num_tokens: int) -> None:
        need = self.blocks_needed(seq, num_tokens)
        if need > self.blocks.num_free:
            raise RuntimeError(f"KV cache out of blocks: need {need}, {self.blocks.num_free} free")
        before = len(seq.block_table)
        self.blocks.grow(seq.block_table, num_tokens)
        if self.pages is not None:
            # NOTE: in a two-sweep prefill the late window pages come with the late sweep (prepare)
            self.pages.attach(seq.block_table[before:], eager=seq.fill.stage.done)

    def trim(self, seq) -> None:
        """After a step: sliding-window groups give back the pages no later row of seq can see.
        Below the split rows run in order (the lower sweep, then decoding), so the lowest row
        to come is num_computed. Above it a two-sweep prefill runs its queue (exact prefix rows,
        then the tail, in position order) once the lower sweep has chosen the exact rows: until
        then nothing there can go."""
        if self.pages is None or not seq.block_table:
            return
        if not seq.fill.stage.done and not self.pages.layout.split:  # NOTE: groups not cut at the split
            return
        self.pages.trim(seq.block_table, seq.num_computed, _late_reach(seq))

    def rollback(self, seq, num_valid: int, num_kept: int, verified_row: int | None = None) -> None:
        """A verification step rejected draft rows: positions from `num_valid` on hold rejected
        K/V (overwritten when recomputed, so only the blocks matter) and blocks past those for
        `num_kept` positions go back. Recurrent states have absorbed every verified row: they
        go back to their snapshot after row `verified_row` of the verification (the pool's)."""
        keep = -(-max(num_valid, num_kept) // self.blocks.block_size)
        if self.pages is not None:
            self.pages.release(seq.block_table, keep)
        self.blocks.shrink(seq.block_table, max(num_valid, num_kept))
        if verified_row is not None and seq.state_slot is not None:
            self._on_rollback(seq.state_slot, verified_row)

    def settle(self, seq) -> None:
        """After a step: a sequence whose two-sweep prefill is over gives its stash back."""
        slot = seq.state_slot
        if slot is not None and seq.fill.stage.done and self._stash_rows.pop(slot, None) is not None:
            self._on_stash_done(slot)

    def copies_needed(self, seq, indices: list[int]) -> int:
        """Free blocks make_private(seq, indices) takes: one per block another table holds too."""
        return self.blocks.num_shared(seq.block_table, indices)

    def make_private(self, seq, indices: list[int]) -> list[tuple[int, int]]:
        """Before seq rewrites rows of blocks it may share (reuse_filled = "reselect"): those
        blocks become its own; returns the (source, copy) pairs the runner copies."""
        if self.pages is not None:
            raise RuntimeError("window pages are not copied: a reselecting filled request takes no hit there")
        need = self.copies_needed(seq, indices)
        if need > self.blocks.num_free:
            raise RuntimeError(f"KV cache out of blocks: need {need} copies, {self.blocks.num_free} free")
        seq.prefix.block_keys = seq.prefix.block_keys[: min(indices)] if indices else seq.prefix.block_keys
        return self.blocks.make_own(seq.block_table, indices)

    def publish(self, seq) -> None:
        """After a step: seq's newly final full blocks become prefix-cache entries."""
        if self.prefix is not None:
            published = self.prefix.publish(seq)
            if self.pages is not None:
                self.pages.publish(seq.block_table, published)

    def free(self, seq) -> None:
        """Give back everything seq holds: its blocks (what it computed stays cached until the
        room is needed), its state slot and its stash."""
        self.publish(seq)
        if self.snapshots is not None:
            self.snapshots.let_go(seq)
        if self.prefix is not None:
            self.prefix.unclaim(seq)
        if self.pages is not None:
            self.pages.release(seq.block_table)
            self.pages.forget(seq.block_table)
        self.blocks.free(seq.block_table)
        seq.prefix.block_keys = []
        seq.prefix.restore = None
        slot = seq.state_slot
        if slot is None:
            return
        seq.state_slot = None
        self._stash_rows.pop(slot, None)
        self._free_slots.append(slot)
        self._on_free_slot(slot)

    def preempt(self, seq) -> None:
        """Recompute preemption: the sequence keeps its tokens and nothing else."""
        self.free(seq)

    # -- accounting -------------------------------------------------------------------------

    def stats(self) -> CacheStats:
        rows = sum(self._stash_rows.values())
        return CacheStats(
            kv_blocks_used=self.blocks.num_blocks - self.blocks.num_free,
            kv_blocks_total=self.blocks.num_blocks,
            state_slots_used=self.num_state_slots - len(self._free_slots),
            state_slots_total=self.num_state_slots,
            stash_rows=rows,
            stash_bytes=rows * self.stash_bytes_per_row,
            prefix_cached_blocks=self.blocks.num_cached,
            prefix_queried_tokens=self.prefix.queried_tokens if self.prefix else 0,
            prefix_hit_tokens=self.prefix.hit_tokens if self.prefix else 0,
            prefix_window_cut_tokens=self.prefix.window_cut_tokens if self.prefix else 0,
            prefix_state_cut_tokens=self.prefix.state_cut_tokens if self.prefix else 0,
            prefix_evictions=self.blocks.evictions,
            kv_touched_bytes=self.blocks.num_touched * self.kv_bytes_per_block,
            state_snapshots=self.snapshots.table.num_published if self.snapshots else 0,
            state_restores=self.snapshots.table.restores if self.snapshots else 0,
        )


def _late_reach(seq) -> int | None:
    """The lowest position a later row of seq runs at in the layers above the split; None while
    the lower sweep or the probe runs (the exact rows are not chosen yet)."""
    if seq.fill.stage.done:
        return seq.num_computed
    if seq.fill.stage is Stage.LATE and seq.fill.queue_done < len(seq.fill.queue):
        return seq.fill.queue[seq.fill.queue_done]
    return None
