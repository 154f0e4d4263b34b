"""A step's layout, sequence by sequence, and the one place it becomes an AttentionBatch.

Whoever runs rows through the model (the runner's step, a decode graph over its static buffers,
a looped model's draft pass, the fill's late part, a one-document capture) says per sequence how
many query rows it has, which keys they see and where those live, and its recurrent state;
attention_batch lays that out as the flat batch every layer reads.

NOTE: here, beside the runner, rather than in layers/: the layers only read an AttentionBatch and
the runner side builds it. The module imports layers.attention alone (never fill/ or the
scheduler), so fill/ builds its late part's batches here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .layers.attention import AttentionBatch, ContextSlots, PagedRows


@dataclass(frozen=True)
class SeqLayout:
    """One sequence's part of a step: its query rows (consecutive in the flat batch) and the keys
    they attend to. With neither read_table nor read_slots every key is one of this step's rows
    (a fresh prefill): nothing is read from the cache."""

    rows: int  # query rows this step
    # The rows see positions 0..context_len-1 (after this step's writes); without query_pos they
    # are the last `rows` of them
    context_len: int
    read_table: list[int] | None = None  # read positions 0..context_len-1 through this block table
    read_slots: torch.Tensor | None = None  # [K] int64: or read the keys at these slots
    query_pos: torch.Tensor | None = None  # [rows] int64: scattered rows' positions
    key_pos: torch.Tensor | None = None  # [K] int64: the positions of read_slots' keys (None: 0..K-1)
    state_slot: int | None = None  # its row in the state pool (None: it keeps no recurrent state)
    # Its recurrent states start from zero at its first row; None: iff its rows start at position 0
    fresh: bool | None = None
    verifies: bool = False  # its rows verify a speculative draft

    def __post_init__(self):
        if self.rows < 0 or self.context_len < 0:
            raise ValueError(f"SeqLayout: rows {self.rows} and context_len {self.context_len} must be >= 0")
        if self.read_table is not None and self.read_slots is not None:
            raise ValueError("SeqLayout: keys are read through the block table or from given slots, not both")
        if self.query_pos is None and self.rows > self.context_len:
            raise ValueError(f"SeqLayout: {self.rows} last rows of a context of {self.context_len}")
        if self.query_pos is not None and self.query_pos.shape[0] != self.rows:
            raise ValueError(f"SeqLayout: {self.query_pos.shape[0]} query positions for {self.rows} rows")
        if self.key_pos is not None and (self.read_slots is None or self.key_pos.shape != self.read_slots.shape):
            raise ValueError("SeqLayout: key_pos needs read_slots of the same length")

    @property
    def fresh_state(self) -> bool:
        """Whether its recurrent states start from zero at its first row."""
        return self.fresh if self.fresh is not None else self.context_len == self.rows


def attention_batch(
    seqs: Sequence[SeqLayout],
    write_slots: torch.Tensor,
    *,
    block_size: int = 0,
    device: torch.device | str | None = None,
    block_tables: torch.Tensor | None = None,
    paged_given: PagedRows | None = None,
) -> AttentionBatch:
    """The flat batch of sequences `seqs`, in order; write_slots [N] int64 is the cache slot of
    each of their rows. block_size: the cache's (needed where a sequence has a read_table);
    device: where read-through-table slots are made. block_tables int32 [B, max_blocks]
    (padded_block_tables) and paged_given hand the batched kernel its inputs; without tables
    every sequence attends on its own path."""
    if block_size <= 0 and (block_tables is not None or any(s.read_table is not None for s in seqs)):
        raise ValueError(f"attention_batch: block tables need the block size, got {block_size}")
    if device is None and any(s.read_table is not None for s in seqs):
        raise ValueError("attention_batch: a sequence read through its block table needs the device")
    if block_tables is not None and block_tables.shape[0] != len(seqs):
        raise ValueError(f"attention_batch: {block_tables.shape[0]} block tables for {len(seqs)} sequences")
    starts = [0]
    for s in seqs:
        starts.append(starts[-1] + s.rows)
    lens = [s.context_len for s in seqs]
    # NOTE: a per-sequence list that says nothing (no scattered row, no state, no draft) is None:
    # the layers test these lists for None before looking at a sequence (a draft's history, say)
    given_fresh = any(s.fresh is not None for s in seqs)
    return AttentionBatch(
        query_starts=starts,
        context_lens=lens,
        write_slots=write_slots,
        read_slots=ContextSlots([s.read_table for s in seqs], lens, block_size, device, [s.read_slots for s in seqs]),
        query_pos=_unless_all_none([s.query_pos for s in seqs]),
        key_pos=_unless_all_none([s.key_pos for s in seqs]),
        state_slots=_unless_all_none([s.state_slot for s in seqs]),
        state_fresh=[s.fresh_state for s in seqs] if given_fresh else None,
        verifies=[s.verifies for s in seqs] if any(s.verifies for s in seqs) else None,
        block_tables=block_tables,
        block_size=block_size,
        paged_given=paged_given,
    )


def padded_block_tables(tables: list[list[int]]) -> torch.Tensor:
    """int32 [B, max_blocks], each sequence's table padded with block 0 (never read: a row reads
    positions below its context length only)."""
    width = max((len(t) for t in tables), default=0)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32).reshape(len(tables), width)


def _unless_all_none(xs: list) -> list | None:
    return None if all(x is None for x in xs) else xs
