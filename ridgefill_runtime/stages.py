"""The two-sweep prefill's bookkeeping (seed 000, §2.4 and Figure 5): what a sequence runs next
and how a step's result moves it on. Plain Python, no tensors; shared by the scheduler and the
offline driver so both walk the same stages.

  lower  layers below the split for every row, in chunks; the prefix rows' late K/V are filled
  probe  (when the probe selector is on) the last rows run the exact late layers over the filled
         cache and every prefix row's late attention is recorded
  late   the chosen exact prefix rows, then the tail, run the late layers, in position order, in
         chunks; their K/V overwrite the filled ones. The last chunk samples the first token.
         On a hybrid (seq.fill.carry_all_rows) every prefix row takes part: filled rows update the
         late recurrent states from their predicted inputs and nothing else.
  recover  (reuse_filled = "reselect") cached rows whose late K/V the new selection changes (past
         the first row it chooses otherwise) run the lower layers again, as scattered rows over the
         cached lower K/V, to recover their split states; rows no longer chosen write their filled
         late K/V there, and the late sweep takes the chosen ones
  full   an ordinary sequence: no fill, or the fill is done (decode)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from collections.abc import Callable

if TYPE_CHECKING:  # NOTE: sequence.py imports Stage from here
    from .sequence import Sequence

Select = Callable[["Sequence"], list[int]]  # a sequence past its lower sweep -> exact prefix rows


class Stage(enum.StrEnum):
    """Where a sequence is in the two-sweep prefill. A StrEnum: it reads and prints as its name
    ("lower", ...), so logs and tests that spell the stage as text keep working."""

    LOWER = "lower"
    PROBE = "probe"
    RECOVER = "recover"
    LATE = "late"
    FULL = "full"

    @property
    def done(self) -> bool:
        """No two-sweep work left: an ordinary sequence (no fill, or the fill is over). The one
        test of "the fill's stages are finished" (the stash goes, decoding may start)."""
        return self is Stage.FULL

    @property
    def from_tokens(self) -> bool:
        """Its rows run from their tokens at layer 0 (the lower part); otherwise they are queued
        positions joining the late layers from the stash."""
        return self is Stage.FULL or self is Stage.LOWER or self is Stage.RECOVER

    @property
    def queued(self) -> bool:
        """Its rows are positions taken from the sequence's queue (maybe scattered); otherwise
        they are the next positions."""
        return not (self is Stage.FULL or self is Stage.LOWER)

    @property
    def reaches_top(self) -> bool:
        """Its rows run the last layer, so they may have logits (sample, score)."""
        return self is Stage.FULL or self is Stage.LATE


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step
    num_tokens: int  # rows computed this step
    kind: Stage = Stage.FULL  # the sequence's stage
    positions: list[int] | None = None  # probe/late: the rows' positions (sorted, maybe scattered)
    # speculative decoding: tokens proposed after the last known one, verified this step; they
    # are the item's last len(draft) rows (num_tokens = 1 + len(draft) for a decode)
    draft: list[int] = field(default_factory=list)
    # copy-on-write: (source, copy) block pairs whose K/V the runner copies before the step runs
    copies: list[tuple[int, int]] = field(default_factory=list)
    # a recurrent model's prefix cache (cache/snapshots.py): the snapshot slot whose states the
    # runner loads into the sequence's state slot before the step (a hit), and the one it copies
    # them into after the step (the step ends on a snapshot boundary)
    restore: int | None = None
    snapshot: int | None = None
    turn_snapshot: bool = False  # `snapshot` is the sequence's own, published when it is let go

    @property
    def end(self) -> int:
        """One past the last position computed this step."""
        return self.positions[-1] + 1 if self.positions else self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """This step computes the sequence's last known token through every layer, so it yields
        the next one (and, with a draft, a choice after each draft token)."""
        return self.kind.reaches_top and self.end - len(self.draft) == self.seq.num_tokens

    @property
    def num_sampled(self) -> int:
        """Rows whose logits choose tokens: the last known token's and each draft token's."""
        return 1 + len(self.draft) if self.samples else 0

    def token_ids(self) -> list[int]:
        """The ids of the rows computed from their tokens this step: positions start..end, or
        a recover item's scattered positions."""
        if self.positions is not None:
            return [self.seq.token(p) for p in self.positions]
        known = self.seq.tokens(self.start, self.end - len(self.draft))
        return known + self.draft if self.draft else known


def next_item(seq: Sequence, budget: int, chunk: int, stop: int | None = None) -> ScheduledSeq:
    """The sequence's next piece of work, at most min(chunk, budget) rows; a prefill chunk of an
    exact sequence ends at `stop` if it would pass it (a recurrent state snapshot is due there)."""
    n = min(chunk, budget)
    if stop is not None and not seq.fill.stage.queued and seq.num_computed < stop:
        n = min(n, stop - seq.num_computed)
    if seq.loop is not None and seq.loop.window:
        # NOTE: a looped model's RIPE(W) prefill in chunks of at most W + 1 rows reads every
        # position by Eq. (9) (within a chunk t - j <= W: plane r, which the pass computes), so it
        # does not depend on where chunks start (seed 001 Proposition 1, applied to the prompt)
        n = min(n, seq.loop.window + 1)
    if not seq.fill.stage.queued:
        return ScheduledSeq(seq, seq.num_computed, min(seq.num_tokens - seq.num_computed, n), seq.fill.stage)
    if seq.fill.carry_all_rows and seq.fill.stage is Stage.LATE and seq.fill.queue_done < seq.fill.boundary:
        # NOTE: a chunk ends at the prefix's end, where the terminal-state correction is added
        n = min(n, seq.fill.boundary - seq.fill.queue_done)
    pos = seq.fill.queue[seq.fill.queue_done : seq.fill.queue_done + n]
    return ScheduledSeq(seq, pos[0], len(pos), seq.fill.stage, pos)


def advance(item: ScheduledSeq, scores: dict[str, list[float]] | None, select: Select) -> None:
    """Record that `item` ran; `scores` are the selector scores the step produced, if any."""
    seq = item.seq
    if scores:
        seq.fill.row_scores.update(scores)
    if not item.kind.queued:
        seq.num_computed = item.end
        if item.kind is Stage.LOWER and item.end == seq.num_tokens:
            finish_lower(seq, select)
        return
    seq.fill.queue_done += item.num_tokens
    if seq.fill.queue_done < len(seq.fill.queue):
        return
    if item.kind is Stage.PROBE:
        _enter_late(seq, select)
    elif item.kind is Stage.RECOVER:
        _start_late_sweep(seq)
    else:
        seq.fill.stage = Stage.FULL


def resume_from_cache(seq: Sequence, hit) -> None:
    """Admission found the prompt's first `hit.num_tokens` positions in the prefix cache: they
    count as computed. A filled sequence keeps the cached exact rows as its own and starts its
    lower sweep after them; with the whole prefix cached it has no two-sweep work left."""
    if not hit.num_tokens:
        return
    seq.num_computed = seq.prefix.num_cached = hit.num_tokens
    seq.prefix.cached_filled_rows = hit.filled_rows
    if seq.fill.boundary:
        seq.fill.exact_rows = [r for r in hit.exact_rows if r < seq.fill.boundary]
        # NOTE: "reselect" chooses rows for the new prompt, so its new rows run the lower sweep
        if hit.num_tokens >= seq.fill.boundary and not seq.prefix.reselect:
            seq.fill.stage = Stage.FULL


def usable_hit(seq: Sequence, hit):
    """The part of a prefix hit the sequence may start from. A filled sequence's tail runs every
    layer: the hit ends before the first cached row at or past its fill boundary that was filled.
    Under "reselect" a selector that reads the lower sweep's attention needs its window rows
    computed, so the hit ends before them (token selectors read the prompt alone); the probe reads
    the late K/V of a prefix filled on every row, which cached blocks are not (their exact rows),
    so it takes no cached blocks."""
    if not seq.fill.boundary:
        return hit
    if hit.num_tokens > seq.fill.boundary:
        exact = set(hit.exact_rows)
        filled_tail = next((r for r in range(seq.fill.boundary, hit.num_tokens) if r not in exact), None)
        if filled_tail is not None:
            hit = hit.cut(filled_tail)
    if not (seq.prefix.reselect and seq.fill.rows.lower_attention):
        return hit
    if "probe" in seq.fill.rows.selectors:
        return hit.cut(0)
    end = seq.fill.hide_from if seq.fill.hide_from is not None else len(seq.prompt_ids)
    return hit.cut(max(0, end - seq.fill.rows.window))


def probe_rows(seq: Sequence) -> list[int]:
    """The probe's rows: the last probe_window rows the selectors may see, never prefix rows
    (their K/V would overwrite filled slots), so at most the tail."""
    end = seq.fill.hide_from if seq.fill.hide_from is not None else seq.num_tokens
    lo = max(seq.fill.boundary, end - seq.fill.rows.probe_window)
    return list(range(lo, end))


def finish_lower(seq: Sequence, select: Select) -> None:
    """The lower sweep is done: run the probe next, or choose the rows and start the late sweep."""
    rows = probe_rows(seq) if "probe" in seq.fill.rows.selectors else []
    if rows:
        seq.fill.stage, seq.fill.queue, seq.fill.queue_done = Stage.PROBE, rows, 0
    else:
        _enter_late(seq, select)


def _enter_late(seq: Sequence, select: Select) -> None:
    chosen = set(select(seq))
    cached_exact = {
        r for r in seq.fill.exact_rows if r < seq.prefix.num_cached
    }  # from the prefix cache (resume_from_cache)
    new = {r for r in chosen if r >= seq.prefix.num_cached}
    seq.prefix.remade_rows = []
    if not seq.prefix.reselect:
        # NOTE: rows below num_cached came from the prefix cache as they were made. "as-is" keeps
        # them so: only rows the sequence computes itself can be chosen.
        seq.fill.exact_rows = sorted(cached_exact | new)
        _start_late_sweep(seq)
        return
    # NOTE: "reselect" ends with the fresh fill's rows. A filled row's late K/V depend on its
    # tokens alone, an exact row's on which rows before it are exact: the cache holds the fresh
    # fill's K/V below the first row the two choices differ at, and from there on every chosen
    # row (tail rows included) is remade exact and every other cached exact row is filled again
    # (undone), both after recovering their split states (issue 32)
    seq.fill.exact_rows = sorted(chosen)
    differ = (cached_exact ^ chosen) & set(range(min(seq.prefix.num_cached, seq.fill.boundary)))
    if not differ:
        _start_late_sweep(seq)
        return
    first = min(differ)
    tail = set(range(max(first, seq.fill.boundary), seq.prefix.num_cached))  # cached tail rows: exact, over other rows
    remade = {r for r in chosen if first <= r < seq.prefix.num_cached} | tail
    undone = {r for r in cached_exact - chosen if r >= first}
    seq.prefix.remade_rows = sorted(remade)
    seq.fill.stage, seq.fill.queue, seq.fill.queue_done = Stage.RECOVER, sorted(remade | undone), 0


def _start_late_sweep(seq: Sequence) -> None:
    # NOTE: position order: every key an exact row or tail row reads below its own position is
    # then either filled or already recomputed exactly.
    seq.fill.stage, seq.fill.queue_done = Stage.LATE, 0
    if seq.fill.carry_all_rows:  # every row: filled ones carry the late recurrent states from x̂
        seq.fill.queue = list(range(seq.num_tokens))
        return
    mine = sorted(r for r in seq.fill.exact_rows if r >= seq.prefix.num_cached) + seq.prefix.remade_rows
    seq.fill.queue = sorted(mine) + list(range(max(seq.fill.boundary, seq.prefix.num_cached), seq.num_tokens))
