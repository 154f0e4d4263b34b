"""When a model with per-sequence states (Gated DeltaNet layers, a RIPE ring) snapshots them for
the prefix cache, and where a hit may resume. Ids only: the table says which slot holds what
(snapshots.py); the runner copies the tensors (StatePool.save_snapshot / load_snapshot).

Snapshots are taken after steps that end on a block end:
  - each prompt's last full block, and every `every` blocks: new entries, published under the
    block's history key once the block is published (a prefill chunk is cut to end there);
  - any other block end a decode step reaches: the sequence's own turn snapshot, rewritten each
    time and published when the sequence is let go, so a chat's next turn resumes from the
    answer's last block.
A verification (a draft) rolls states back after its step, so it snapshots nothing. Filled
sequences take no part (a filled prefix's late states are approximate).
"""

from __future__ import annotations

from dataclasses import replace

from .prefix_cache import NO_HIT, PrefixHit
from .snapshots import SnapshotTable


class SnapshotPlan:
    def __init__(self, table: SnapshotTable, block_size: int, every: int = 0):
        self.table = table
        self.block_size = block_size
        self.every = every

    def resume_point(self, seq, hit: PrefixHit) -> PrefixHit:
        """The hit ends at the last of its blocks with a snapshot after it (its key in `state`)."""
        if seq.fill.boundary:
            return replace(NO_HIT, waits=hit.waits)
        keys = hit.keys
        k = next((k for k in range(len(hit.blocks), 0, -1) if self.table.lookup(keys[k - 1]) is not None), 0)
        kept = hit.cut(k * self.block_size)
        cut = hit.num_tokens - kept.num_tokens
        return replace(kept, state=keys[k - 1] if k else None, waits=hit.waits, state_cut=cut)

    def restore(self, hit: PrefixHit) -> int | None:
        """Admission from `hit`: the slot its first step loads (None: the hit needs none)."""
        return None if hit.state is None else self.table.restore(hit.state)

    def stop(self, seq) -> int | None:
        """Where seq's next prefill chunk must end for a due snapshot (None: none before its end)."""
        if seq.fill.boundary:
            return None
        later = [s for s in self._due_points(seq) if s > seq.num_computed]
        return min(later) if later else None

    def _prompt_end(self, seq) -> int:
        """The end of the prompt's last full block before its last token."""
        return (len(seq.prompt_ids) - 1) // self.block_size * self.block_size

    def _due_points(self, seq) -> list[int]:
        points = [self._prompt_end(seq)]
        if self.every:
            span = self.every * self.block_size
            points.append((seq.num_computed // span + 1) * span)
        return points

    def plan(self, item) -> None:
        """Before a step runs: the slot item's states are copied into after it, if any."""
        seq, bs, end = item.seq, self.block_size, item.end
        if seq.fill.boundary or item.draft or item.positions is not None or end == 0 or end % bs:
            return
        if end == self._prompt_end(seq) or (self.every and end % (self.every * bs) == 0):
            item.snapshot = self.table.take()
        elif item.samples:
            if seq.prefix.turn_snapshot is None:
                seq.prefix.turn_snapshot = self.table.take()
            item.snapshot, item.turn_snapshot = seq.prefix.turn_snapshot, True
            seq.prefix.turn_block = end // bs - 1  # NOTE: now: the step runs before anything can let seq go

    def publish(self, item) -> None:
        """After a step: a new snapshot at the end of block i becomes findable under that block's
        key once the block is published (it always is, unless the sequence was let go)."""
        if item.snapshot is None or item.turn_snapshot:
            return
        self._publish(item.snapshot, item.end // self.block_size - 1, item.seq.prefix.block_keys)

    def let_go(self, seq) -> None:
        """seq is let go (before its block keys are): its turn snapshot becomes an entry."""
        slot, seq.prefix.turn_snapshot = seq.prefix.turn_snapshot, None
        if slot is not None:
            self._publish(slot, seq.prefix.turn_block, seq.prefix.block_keys)

    def _publish(self, slot: int, block: int, keys: list[bytes]) -> None:
        if block < len(keys):
            self.table.publish(slot, keys[block])
        else:
            self.table.give_back(slot)
