"""Runner-side: turn a step's scheduled items into a FillStep (or None when no fill applies),
with where the step's attention measurements go (each sequence's stash, which the model never
touches).

The lower part is the rows of `full` and `lower` items (they run layers below the split);
the late part is, item by item, the `full` items' rows and the `probe` / `late` items' rows,
which start from split states stashed by earlier steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

import torch

from ..config import FillConfig
from ..layers.attention import AttentionBatch
from ..stages import Stage
from ..step_layout import SeqLayout, attention_batch
from .step import (
    FilledLateRows,
    FillStep,
    LatePart,
    LowerPart,
    MassRequest,
    Predictor,
    Rescale,
    TerminalCorrection,
    WindowWrites,
)

SlotsOf = Callable[[object, torch.Tensor], torch.Tensor]  # (seq, positions [n]) -> cache slots [n]


@dataclass(frozen=True)
class PlannedFill:
    """What the model runs (`step`) and, runner-side, where its measurements are kept: per
    step.lower.mass / step.late.mass request, the stash accumulator ([boundary] float32) that
    the attention its prefix keys receive adds into."""

    step: FillStep
    lower_mass_into: list[torch.Tensor]
    late_mass_into: list[torch.Tensor]


def rewrites_filled_rows(config: FillConfig) -> bool:
    """The rescale multiplies every filled row's late K/V at once, so each must be written first:
    the fill then cannot write a sliding-window row only when a late row reaches it."""
    return config.value_rescale or config.key_rescale


def needs_fill_step(items) -> bool:
    return any(not it.kind.done or (it.seq.fill.boundary and it.seq.fill.arm == "nofill") for it in items)


class FillPlanner:
    def __init__(
        self,
        config: FillConfig,
        predict: Predictor | None,
        slots_of: SlotsOf,
        states,
        model_config,
        dtype,
        device,
        attention_layers=None,
        terminal_shift=None,
        defer_windows: bool = False,
    ):
        """states: the StatePool whose slots hold each sequence's split-state stash;
        attention_layers: the layers with K/V (None: every layer), the only ones attention
        measurements can be taken at. defer_windows: write a filled row's K/V at sliding-window
        late layers only when a later row reaches it (nothing else may read the filled cache: no
        prefix cache, no splice; the rescale, which rewrites every filled row at once, turns it off)."""
        self.config, self.predict, self.slots_of = config, predict, slots_of
        self.states, self.dtype, self.device = states, dtype, device
        self.width, self.num_layers = model_config.hidden_size, model_config.num_layers
        self.attention_layers = frozenset(range(self.num_layers) if attention_layers is None else attention_layers)
        self.terminal_shift = terminal_shift  # layer -> ΔM, when the terminal-state correction is on
        window_of = model_config.family_config.window_of
        late = [window_of(i) for i in range(config.split, self.num_layers) if i in self.attention_layers]
        self.late_window = max(late, default=0)  # NOTE: the widest: a narrower layer reads a subset
        self.defer_windows = (
            defer_windows and self.late_window > 0 and predict is not None and not rewrites_filled_rows(config)
        )

    def build(self, items, batch: AttentionBatch) -> PlannedFill:
        """batch: the lower part's layout (one entry per full / lower item, in item order)."""
        acc = _Parts(self.device)
        lower_k = 0
        for item in items:
            if item.kind.from_tokens:
                lo, hi = batch.query_starts[lower_k], batch.query_starts[lower_k + 1]
                rows = torch.arange(lo, hi, device=self.device)
                if item.kind is Stage.LOWER:
                    self._lower_item(item, rows, batch.write_slots[rows], acc)
                elif item.kind is Stage.RECOVER:
                    # NOTE: the split states; rows chosen exact are remade by the late sweep next,
                    # the cached exact rows no longer chosen write their filled late K/V now
                    acc.exit_rows.append(rows)
                    self._undone_rows(item, rows, batch.write_slots[rows], acc)
                else:
                    self._stay_item(item, rows, batch, lower_k, acc)
                lower_k += 1
            else:
                self._late_item(item, acc)
        return acc.finish(
            self.config.split, self.predict, self.width, self.dtype, self.terminal_shift, self.defer_windows
        )

    # -- the three kinds of item ----------------------------------------------------------------

    def _lower_item(self, item, rows, slots, acc: _Parts) -> None:
        seq = item.seq
        if item.start == seq.prefix.num_cached:  # a new (or restarted) prefill: a fresh stash
            self.states.new_stash(seq.state_slot, seq.num_tokens, seq.fill.boundary)
        acc.exit_rows.append(rows)
        if self.predict is not None and seq.fill.arm != "nofill":
            n_fill = max(0, min(seq.fill.boundary - item.start, item.num_tokens))
            acc.fills.append((rows[:n_fill], slots[:n_fill]))
        if seq.fill.rows.lower_attention:
            self._window_mass(item, rows, acc)

    def _undone_rows(self, item, rows, slots, acc: _Parts) -> None:
        """A recover item's prefix rows that the sequence does not make exact: filled again."""
        seq = item.seq
        if self.predict is None or seq.fill.arm == "nofill":
            return
        exact = set(seq.fill.exact_rows)
        keep = [k for k, p in enumerate(item.positions) if p < seq.fill.boundary and p not in exact]
        if keep:
            pick = torch.tensor(keep, dtype=torch.int64, device=self.device)
            acc.fills.append((rows[pick], slots[pick]))

    def _window_mass(self, item, rows, acc: _Parts) -> None:
        """The attention selector's scores: what the last `window` rows the selectors may see
        pay to each prefix row in the chosen layers below the split."""
        seq = item.seq
        end = seq.fill.hide_from if seq.fill.hide_from is not None else seq.num_tokens
        lo, hi = max(item.start, end - seq.fill.rows.window), min(item.end, end)
        layers = frozenset(x for x in seq.fill.rows.attention_layers if x < self.config.split) & self.attention_layers
        if lo >= hi or not layers:
            return
        keys = torch.arange(item.end, device=self.device)
        pick = rows[lo - item.start : hi - item.start]
        request = MassRequest(layers, pick, torch.arange(lo, hi, device=self.device), self.slots_of(seq, keys), keys)
        acc.lower_mass.append((request, self.states.stash(seq.state_slot).attention))

    def _stay_item(self, item, rows, batch: AttentionBatch, k: int, acc: _Parts) -> None:
        seq = item.seq
        read, key_pos = batch.read_slots[k], None
        if seq.fill.boundary and seq.fill.arm == "nofill":
            # NOTE: no fill: the late layers never see the prefix rows that were not recomputed.
            key_pos = torch.tensor(
                seq.fill.exact_rows + list(range(seq.fill.boundary, item.end)), dtype=torch.int64, device=self.device
            )
            read = self.slots_of(seq, key_pos)
        acc.stay_rows.append(rows)
        layout = SeqLayout(
            rows=item.num_tokens,
            context_len=item.end,
            read_slots=read,
            key_pos=key_pos,
            state_slot=seq.state_slot,
            fresh=item.end == item.num_tokens,  # its recurrent states start afresh iff it starts the prompt
            verifies=bool(item.draft),
        )
        acc.add_late(layout, batch.write_slots[rows])

    def _late_item(self, item, acc: _Parts) -> None:
        seq = item.seq
        stash = self.states.stash(seq.state_slot)
        pos = torch.tensor(item.positions, dtype=torch.int64, device=self.device)
        keys = self._late_keys(item)
        read = self.slots_of(seq, keys if keys is not None else torch.arange(item.end, device=self.device))
        if self.defer_windows and seq.fill.arm != "nofill" and not seq.fill.carry_all_rows:
            self._window_writes(seq, stash, pos, acc)
        # NOTE: the probe's first rows start a scratch recurrent state (seed 000 §2.4: thrown away;
        # the late sweep starts afresh at position 0), the late sweep's first rows a real one.
        layout = SeqLayout(
            rows=item.num_tokens,
            context_len=read.shape[0],
            read_slots=read,
            query_pos=pos,
            key_pos=keys,
            state_slot=seq.state_slot,
            fresh=seq.fill.queue_done == 0,
        )
        rows = acc.add_late(layout, self.slots_of(seq, pos), x=stash.x[pos], filled=self._filled(item, pos))
        if seq.fill.terminal_state and item.kind is Stage.LATE and item.end == seq.fill.boundary:
            acc.prefix_ends.append(len(acc.late) - 1)
        if item.kind is Stage.PROBE:
            key_pos = keys if keys is not None else torch.arange(item.end, device=self.device)
            layers = frozenset(range(self.config.split, self.num_layers)) & self.attention_layers
            acc.late_mass.append((MassRequest(layers, rows, pos, read, key_pos), stash.probe))
        elif self._rescales(seq) and self._measures_rescale(item):
            c = min(self.config.rescale_rows, item.num_tokens)
            acc.rescales.append(
                Rescale(
                    rows=rows[:c],
                    values=self.config.value_rescale,
                    keys=self.config.key_rescale,
                    filled_slots=self.slots_of(seq, self._rescaled_positions(seq)),
                )
            )

    def _window_writes(self, seq, stash, pos: torch.Tensor, acc: _Parts) -> None:
        """The filled rows that rows `pos` [n] are the first to reach at the sliding-window late
        layers (less than `window` positions before one of them): written there this step.
        NOTE: queued rows run in position order, so a row's window is written by its own step
        or an earlier one, and exact prefix rows (never filled) have made their own K/V by then."""
        back = torch.arange(1, self.late_window, device=self.device)  # [w-1]
        near = (pos[:, None] - back[None, :]).flatten()  # [n * (w-1)] positions q - w < p < q
        near = near[(near >= 0) & (near < seq.fill.boundary)].unique()
        exact = torch.tensor(seq.fill.exact_rows, dtype=torch.int64, device=self.device)
        need = near[~stash.window_written[near] & ~torch.isin(near, exact)]  # [W]
        if len(need) == 0:
            return
        stash.window_written[need] = True
        acc.windows.append((stash.x[need], need, self.slots_of(seq, need)))

    def _filled(self, item, pos: torch.Tensor) -> torch.Tensor | None:
        """[n] bool: which of a late item's rows are filled prefix rows (hybrids walk them too)."""
        seq = item.seq
        if not (seq.fill.carry_all_rows and item.kind is Stage.LATE):
            return None
        exact = torch.tensor(seq.fill.exact_rows, dtype=torch.int64, device=self.device)
        return (pos < seq.fill.boundary) & ~torch.isin(pos, exact)

    def _late_keys(self, item) -> torch.Tensor | None:
        """Positions a probe / late item's rows may read (None: every position before its end)."""
        seq = item.seq
        filled = seq.fill.arm != "nofill"
        if item.kind is Stage.PROBE:
            # NOTE: tail rows before the probe rows have no late K/V yet: the probe reads the
            # filled prefix and the probe rows only.
            prefix = list(range(seq.fill.boundary)) if filled else []
            return torch.tensor(
                prefix + list(range(seq.fill.queue[0], item.end)), dtype=torch.int64, device=self.device
            )
        if filled:
            return None
        done = seq.fill.queue[: seq.fill.queue_done + item.num_tokens]  # exact rows and tail so far, in order
        return torch.tensor(done, dtype=torch.int64, device=self.device)

    @staticmethod
    def _measures_rescale(item) -> bool:
        """The late item whose first rows measure the rescale: the late sweep's first; on a hybrid
        (which walks the prefix first) the first holding tail rows, so the ratios come from the
        first c tail rows and apply before the tail reads the filled rows."""
        seq = item.seq
        if seq.fill.carry_all_rows:
            return item.positions[0] == seq.fill.boundary
        return seq.fill.queue_done == 0

    def _rescaled_positions(self, seq) -> torch.Tensor:
        """The filled prefix rows' positions (on a hybrid the exact prefix rows are recomputed by
        then and keep their exact values)."""
        prefix = torch.arange(seq.fill.boundary, device=self.device)
        if not seq.fill.carry_all_rows:
            return prefix
        exact = torch.tensor(seq.fill.exact_rows, dtype=torch.int64, device=self.device)
        return prefix[~torch.isin(prefix, exact)]

    def _rescales(self, seq) -> bool:
        """The first late rows of a filled sequence measure and apply the rescale."""
        return seq.fill.arm in ("identity", "ridgefill") and (self.config.value_rescale or self.config.key_rescale)


@dataclass(frozen=True)
class _LateEntry:
    """One item's rows in the late part: where they sit in it, their layout, and where they write."""

    to: torch.Tensor  # [n] int64: the rows' indices in the late part
    layout: SeqLayout
    write: torch.Tensor  # [n] int64: their cache slots
    x: torch.Tensor | None = None  # [n, width]: a queued item's stashed split states (None: a `full` item's rows)
    filled: torch.Tensor | None = None  # [n] bool: filled prefix rows (a hybrid's late sweep walks them)


class _Parts:
    """Accumulates a FillStep's pieces item by item: the lower part's row sets, one _LateEntry per
    item in the late part, and the measurements asked for (each with its stash accumulator)."""

    def __init__(self, device: torch.device | str | None) -> None:
        self.device = device
        self.exit_rows: list[torch.Tensor] = []  # rows that leave the lower part at the split
        self.fills: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rows, slots) writing filled late K/V
        self.stay_rows: list[torch.Tensor] = []  # rows of `full` items, which go on into the late part
        self.late: list[_LateEntry] = []
        self.late_size = 0
        self.lower_mass: list[tuple[MassRequest, torch.Tensor]] = []  # (request, stash accumulator)
        self.late_mass: list[tuple[MassRequest, torch.Tensor]] = []
        self.rescales: list[Rescale] = []
        self.prefix_ends: list[int] = []  # late entries that end a prefix (the terminal correction)
        self.windows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (x, pos, slots) first reached

    def add_late(self, layout: SeqLayout, write, x=None, filled=None) -> torch.Tensor:
        """Append one item's rows to the late part; returns their indices in it ([n] int64)."""
        start, self.late_size = self.late_size, self.late_size + layout.rows
        to = torch.arange(start, self.late_size, device=self.device)
        self.late.append(_LateEntry(to, layout, write, x, filled))
        return to

    def finish(self, split, predict, width, dtype, terminal_shift=None, defer_windows=False) -> PlannedFill:
        device = self.device
        cat = lambda xs: torch.cat(xs) if xs else torch.empty(0, dtype=torch.int64, device=device)  # noqa: E731
        queued = [e for e in self.late if e.x is not None]
        batch = attention_batch([e.layout for e in self.late], cat([e.write for e in self.late]))
        filled, exact, exact_batch = self._exact_part(batch)
        late_x = torch.cat([e.x for e in queued]) if queued else torch.empty(0, width, dtype=dtype, device=device)
        windows = None
        if defer_windows:  # the rows a late row reaches first this step (maybe none)
            window_x = torch.cat([w[0] for w in self.windows]) if self.windows else late_x.new_empty(0, width)
            windows = WindowWrites(window_x, cat([w[1] for w in self.windows]), cat([w[2] for w in self.windows]))
        step = FillStep(
            split=split,
            predict=predict,
            lower=LowerPart(
                exit_rows=cat(self.exit_rows),
                fill_rows=cat([rows for rows, _ in self.fills]),
                fill_slots=cat([slots for _, slots in self.fills]),
                stay_rows=cat(self.stay_rows),
                mass=tuple(m for m, _ in self.lower_mass),
            ),
            late=LatePart(
                size=self.late_size,
                batch=batch,
                stay_to=cat([e.to for e in self.late if e.x is None]),
                x=late_x,
                pos=cat([e.layout.query_pos for e in queued]),
                to=cat([e.to for e in queued]),
                mass=tuple(m for m, _ in self.late_mass),
                rescales=tuple(self.rescales),
            ),
            filled_late=None if filled is None else FilledLateRows(filled, exact, exact_batch),
            terminal=None if terminal_shift is None else TerminalCorrection(terminal_shift, tuple(self.prefix_ends)),
            windows=windows,
        )
        return PlannedFill(step, [into for _, into in self.lower_mass], [into for _, into in self.late_mass])

    def _exact_part(self, batch: AttentionBatch):
        """With filled rows in the late part: the mask, the other rows' indices and their own
        attention layout (sequences left with no such row drop out of it)."""
        if all(e.filled is None or not bool(e.filled.any()) for e in self.late):
            return None, None, None
        masks = [
            e.filled if e.filled is not None else torch.zeros(e.layout.rows, dtype=torch.bool, device=self.device)
            for e in self.late
        ]
        filled = torch.cat(masks)  # [M]
        seqs = []
        for e, mask in zip(self.late, masks):
            keep = (~mask).nonzero().flatten()
            if len(keep) == 0:
                continue
            q = e.layout.query_pos
            # NOTE: the exact rows' own layout carries no fresh/verifies flags: it serves attention only
            seqs.append(
                SeqLayout(
                    rows=len(keep),
                    context_len=e.layout.context_len,
                    read_slots=e.layout.read_slots,
                    query_pos=None if q is None else q[keep],
                    key_pos=e.layout.key_pos,
                    state_slot=e.layout.state_slot,
                )
            )
        exact = (~filled).nonzero().flatten()  # [E]
        return filled, exact, attention_batch(seqs, batch.write_slots[exact])
