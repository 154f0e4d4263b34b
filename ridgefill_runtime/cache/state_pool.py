"""Per-sequence state storage, addressed by state slot (the slot the cache manager hands a
running sequence): each recurrent layer's fixed-size state, and the fill's split-state stash
while the sequence is in its two-sweep prefill.

Tensor side only: which sequence holds which slot is the cache manager's business (manager.py).
"""

from __future__ import annotations

import torch

from .split_stash import SplitStash
from .spec import CacheSpec, LoopPlanesCache, RecurrentCache


class StatePool:
    def __init__(
        self, spec: CacheSpec, num_slots: int, device: torch.device | str, history_rows: int = 0, snapshots: int = 0
    ):
        """history_rows: the most rows a speculative verification runs (0: none does); snapshots:
        copies of every recurrent layer's state the prefix cache keeps (cache/snapshots.py)."""
        self.num_slots = num_slots
        self.num_snapshots = snapshots if spec.snapshot_bytes() else 0
        self.dtype, self.device = spec.dtype, torch.device(device)
        self.stash_width = spec.stash_width
        # NOTE: zeros, not empty: small (one state per running sequence), and a model may read
        # a fresh slot as "no history" without resetting it first.
        self.states: dict[int, dict[str, torch.Tensor]] = {
            i: {
                name: torch.zeros((num_slots, *shape), dtype=c.dtype or spec.dtype, device=device)
                for name, shape in c.parts
            }
            for i, c in enumerate(spec.layers)
            if isinstance(c, RecurrentCache)
        }  # layer -> part -> [num_slots, *shape]
        self._stashes: dict[int, SplitStash] = {}  # slot -> stash, only while its prefill runs
        # layer -> {"k", "v"} [num_slots, W, R-1, Hkv, D]: a RIPE loop layer's ring of the window's
        # non-deepest planes (seed 001 Eq. (10))
        self.rings: dict[int, dict[str, torch.Tensor]] = {
            i: {part: torch.zeros((num_slots, *c.ring_shape), dtype=spec.dtype, device=device) for part in ("k", "v")}
            for i, c in enumerate(spec.layers)
            if isinstance(c, LoopPlanesCache) and c.ring_shape is not None
        }
        # layer -> {"k", "v"} [num_slots, history_rows, R-1, Hkv, D]: a verification's ring rows,
        # committed to the ring by restore_row once the accepted rows are known (Algorithm 1 line 7)
        self.pending: dict[int, dict[str, torch.Tensor]] = {
            i: {
                part: torch.zeros((num_slots, history_rows, *c.ring_shape[1:]), dtype=spec.dtype, device=device)
                for part in ("k", "v")
            }
            for i, c in enumerate(spec.layers)
            if isinstance(c, LoopPlanesCache) and c.ring_shape is not None and history_rows > 0
        }
        self.pending_from: dict[int, int] = {}  # slot -> position of its pending row 0
        self.ring_width = {
            i: c.window
            for i, c in enumerate(spec.layers)
            if isinstance(c, LoopPlanesCache) and c.ring_shape is not None
        }
        # layer -> part -> [num_slots, history_rows, *shape]: the state after each row of the
        # slot's last verification, written by the model, read back by restore_row
        self.histories: dict[int, dict[str, torch.Tensor]] = {
            i: {
                name: torch.zeros((num_slots, history_rows, *shape), dtype=c.dtype or spec.dtype, device=device)
                for name, shape in c.parts
                if name in c.rollback_parts
            }
            for i, c in enumerate(spec.layers)
            if isinstance(c, RecurrentCache) and history_rows > 0
        }

        # layer -> part -> [snapshots, *shape]: every recurrent part and RIPE ring, as after a
        # cached block. NOTE: empty, not zeros: a snapshot is read only after it was written, and
        # untouched pages cost no resident memory
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {
            i: {
                name: torch.empty((self.num_snapshots, *t.shape[1:]), dtype=t.dtype, device=device)
                for name, t in parts.items()
            }
            for i, parts in self._per_sequence().items()
        }

    # -- recurrent states --------------------------------------------------------------------

    def state(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer's state parts, each [num_slots, *shape]; rows are indexed by state slot."""
        return self.states[layer]

    def history(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer's per-row snapshots of its rollback parts, each [num_slots, history_rows, *shape]."""
        return self.histories[layer]

    def restore_row(self, slot: int, row: int) -> None:
        """A verification accepted rows 0..row only: put the states after that row back, and
        move those rows' pending ring planes into the ring (the rest never enter it)."""
        for layer, parts in self.histories.items():
            for name, hist in parts.items():
                self.states[layer][name][slot] = hist[slot, row]
        start = self.pending_from.pop(slot, None)
        if start is None:
            return
        for layer, pending in self.pending.items():
            width = self.ring_width[layer]
            keep = min(row + 1, width)  # NOTE: only the window's positions stay
            rows = torch.arange(row + 1 - keep, row + 1, device=self.device)
            at = (rows + start) % width
            for part in ("k", "v"):
                self.rings[layer][part][slot, at] = pending[part][slot, rows]

    def _per_sequence(self) -> dict[int, dict[str, torch.Tensor]]:
        """What a slot holds that sums up its sequence's prefix: recurrent states, RIPE rings."""
        return {**self.states, **self.rings}

    def save_snapshot(self, slot: int, snapshot: int) -> None:
        """Copy the slot's states and rings (as after its sequence's last computed row) into a snapshot."""
        held = self._per_sequence()
        for layer, parts in self.snapshots.items():
            for name, snap in parts.items():
                snap[snapshot] = held[layer][name][slot]

    def load_snapshot(self, snapshot: int, slot: int) -> None:
        """A sequence resumes from a snapshot: its slot's states and rings become the snapshot's."""
        held = self._per_sequence()
        for layer, parts in self.snapshots.items():
            for name, snap in parts.items():
                held[layer][name][slot] = snap[snapshot]

    def free_slot(self, slot: int) -> None:
        """The slot's sequence is gone (finished or preempted): zero its states, drop its stash."""
        for parts in (*self.states.values(), *self.rings.values()):
            for t in parts.values():
                t[slot].zero_()
        self.pending_from.pop(slot, None)
        self.drop_stash(slot)

    # -- the two-sweep prefill's stash -------------------------------------------------------

    def new_stash(self, slot: int, num_rows: int, boundary: int) -> SplitStash:
        """A fresh stash for a (re)started prefill; replaces any left in the slot."""
        stash = SplitStash.new(num_rows, self.stash_width, boundary, self.dtype, self.device)
        self._stashes[slot] = stash
        return stash

    def stash(self, slot: int) -> SplitStash | None:
        return self._stashes.get(slot)

    def put_stash(self, slot: int, stash: SplitStash) -> None:
        self._stashes[slot] = stash

    def drop_stash(self, slot: int) -> None:
        self._stashes.pop(slot, None)

    def stash_bytes(self) -> int:
        """Bytes the stashes hold now."""
        return sum(s.nbytes() for s in self._stashes.values())
