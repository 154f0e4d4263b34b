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
        acc = _Parts()
        lower_k = 0
        for item in items:
            if item.kind.from_tokens:
                lo, hi = batch.query_starts[lower_k], batch.query_starts[lower_k + 1]
                rows = torch.arange(lo, hi, device=self.device)
                if item.kind is Stage.LOWER:
                    self._lower_item(item, rows, batch.write_slots[rows], acc)
                elif item.kind is Stage.RECOVER:
                    # NOTE: only the split states: the rows' filled late K/V are remade exactly next
                    acc.exit_rows.append(rows)
                else:
                    self._stay_item(item, rows, batch, lower_k, acc)
                lower_k += 1
            else:
                self._late_item(item, acc)
        return acc.finish(
            self.config.split,
            self.predict,
            self.width,
            self.dtype,
            self.device,
            self.terminal_shift,
            self.defer_windows,
        )

    # -- the three kinds of item ----------------------------------------------------------------

    def _lower_item(self, item, rows, slots, acc: _Parts) -> None:
        seq = item.seq
        if item.start == seq.prefix.num_cached:  # a new (or restarted) prefill: a fresh stash
            self.states.new_stash(seq.state_slot, seq.num_tokens, seq.fill.boundary)
        acc.exit_rows.append(rows)
        if self.predict is not None and seq.fill.arm != "nofill":
            n_fill = max(0, min(seq.fill.boundary - item.start, item.num_tokens))
            acc.fill_rows.append(rows[:n_fill])
            acc.fill_slots.append(slots[:n_fill])
        if seq.fill.rows.lower_attention:
            self._window_mass(item, rows, acc)

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
        acc.lower_mass.append(
            MassRequest(layers, pick, torch.arange(lo, hi, device=self.device), self.slots_of(seq, keys), keys)
        )
        acc.lower_into.append(self.states.stash(seq.state_slot).attention)

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
        acc.add_late(
            item.num_tokens,
            batch.write_slots[rows],
            item.end,
            read,
            None,
            key_pos,
            seq.state_slot,
            verifies=bool(item.draft),
        )

    def _late_item(self, item, acc: _Parts) -> None:
        seq = item.seq
        stash = self.states.stash(seq.state_slot)
        pos = torch.tensor(item.positions, dtype=torch.int64, device=self.device)
        keys = self._late_keys(item)
        read = self.slots_of(seq, keys if keys is not None else torch.arange(item.end, device=self.device))
        if self.defer_windows and seq.fill.arm != "nofill" and not seq.fill.carry_all_rows:
            self._window_writes(seq, stash, pos, acc)
        start = acc.late_size
        acc.late_x.append(stash.x[pos])
        acc.late_pos.append(pos)
        acc.late_to.append(torch.arange(start, start + item.num_tokens, device=self.device))
        # NOTE: the probe's first rows start a scratch recurrent state (seed 000 §2.4: thrown away;
        # the late sweep starts afresh at position 0), the late sweep's first rows a real one.
        acc.add_late(
            item.num_tokens,
            self.slots_of(seq, pos),
            read.shape[0],
            read,
            pos,
            keys,
            seq.state_slot,
            fresh=seq.fill.queue_done == 0,
            filled=self._filled(item, pos),
        )
        if seq.fill.terminal_state and item.kind is Stage.LATE and item.end == seq.fill.boundary:
            acc.prefix_ends.append(len(acc.ctx) - 1)
        rows = torch.arange(start, start + item.num_tokens, device=self.device)
        if item.kind is Stage.PROBE:
            key_pos = keys if keys is not None else torch.arange(item.end, device=self.device)
            layers = frozenset(range(self.config.split, self.num_layers)) & self.attention_layers
            acc.late_mass.append(MassRequest(layers, rows, pos, read, key_pos))
            acc.late_into.append(stash.probe)
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
        acc.window_x.append(stash.x[need])
        acc.window_pos.append(need)
        acc.window_slots.append(self.slots_of(seq, need))

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


class _Parts:
    """Accumulates a FillStep's pieces item by item."""

    def __init__(self):
        self.exit_rows, self.fill_rows, self.fill_slots, self.stay_rows = [], [], [], []
        self.late_x, self.late_pos, self.late_to = [], [], []
        self.starts, self.ctx, self.read, self.q_pos, self.k_pos, self.write = [0], [], [], [], [], []
        self.lower_mass, self.late_mass, self.rescales = [], [], []
        self.lower_into, self.late_into = [], []  # the stash accumulator of each mass request
        self.slots, self.fresh, self.filled, self.prefix_ends, self.verifies = [], [], [], [], []
        self.window_x, self.window_pos, self.window_slots = [], [], []  # filled rows first reached

    @property
    def late_size(self) -> int:
        return self.starts[-1]

    def add_late(self, n, write, ctx, read, q_pos, k_pos, slot, fresh=None, filled=None, verifies=False) -> None:
        """fresh None: the rows' recurrent states start from zero iff they start at position 0."""
        self.slots.append(slot)
        self.verifies.append(verifies)
        self.fresh.append(fresh if fresh is not None else ctx == n)
        self.filled.append(filled)
        self.starts.append(self.starts[-1] + n)
        self.ctx.append(ctx)
        self.read.append(read)
        self.q_pos.append(q_pos)
        self.k_pos.append(k_pos)
        self.write.append(write)

    def finish(self, split, predict, width, dtype, device, terminal_shift=None, defer_windows=False) -> PlannedFill:
        cat = lambda xs: torch.cat(xs) if xs else torch.empty(0, dtype=torch.int64, device=device)  # noqa: E731
        stay_to = [
            torch.arange(self.starts[k], self.starts[k + 1], device=device)
            for k in range(len(self.ctx))
            if self.q_pos[k] is None
        ]
        seqs = [
            SeqLayout(
                rows=self.starts[k + 1] - self.starts[k],
                context_len=self.ctx[k],
                read_slots=self.read[k],
                query_pos=self.q_pos[k],
                key_pos=self.k_pos[k],
                state_slot=self.slots[k],
                fresh=self.fresh[k],
                verifies=self.verifies[k],
            )
            for k in range(len(self.ctx))
        ]
        batch = attention_batch(seqs, cat(self.write))
        filled, exact, exact_batch = self._exact_part(batch, device)
        late_x = torch.cat(self.late_x) if self.late_x else torch.empty(0, width, dtype=dtype, device=device)
        windows = None
        if defer_windows:  # the rows a late row reaches first this step (maybe none)
            window_x = torch.cat(self.window_x) if self.window_x else late_x.new_empty(0, width)
            windows = WindowWrites(window_x, cat(self.window_pos), cat(self.window_slots))
        step = FillStep(
            split=split,
            predict=predict,
            lower=LowerPart(
                exit_rows=cat(self.exit_rows),
                fill_rows=cat(self.fill_rows),
                fill_slots=cat(self.fill_slots),
                stay_rows=cat(self.stay_rows),
                mass=tuple(self.lower_mass),
            ),
            late=LatePart(
                size=self.late_size,
                batch=batch,
                stay_to=cat(stay_to),
                x=late_x,
                pos=cat(self.late_pos),
                to=cat(self.late_to),
                mass=tuple(self.late_mass),
                rescales=tuple(self.rescales),
            ),
            filled_late=None if filled is None else FilledLateRows(filled, exact, exact_batch),
            terminal=None if terminal_shift is None else TerminalCorrection(terminal_shift, tuple(self.prefix_ends)),
            windows=windows,
        )
        return PlannedFill(step, self.lower_into, self.late_into)

    def _exact_part(self, batch: AttentionBatch, device):
        """With filled rows in the late part: the mask, the other rows' indices and their own
        attention layout (sequences left with no such row drop out of it)."""
        if all(f is None or not bool(f.any()) for f in self.filled):
            return None, None, None
        masks = [
            f if f is not None else torch.zeros(self.starts[k + 1] - self.starts[k], dtype=torch.bool, device=device)
            for k, f in enumerate(self.filled)
        ]
        filled = torch.cat(masks)  # [M]
        starts, ctx, read, q_pos, k_pos, slots = [0], [], [], [], [], []
        for k, mask in enumerate(masks):
            keep = (~mask).nonzero().flatten()
            if len(keep) == 0:
                continue
            starts.append(starts[-1] + len(keep))
            ctx.append(self.ctx[k])
            read.append(self.read[k])
            q_pos.append(None if self.q_pos[k] is None else self.q_pos[k][keep])
            k_pos.append(self.k_pos[k])
            slots.append(self.slots[k])
        exact = (~filled).nonzero().flatten()  # [E]
        seqs = [
            SeqLayout(rows=hi - lo, context_len=c, read_slots=r, query_pos=q, key_pos=kp, state_slot=slot)
            for lo, hi, c, r, q, kp, slot in zip(starts, starts[1:], ctx, read, q_pos, k_pos, slots)
        ]
        exact_batch = attention_batch(seqs, batch.write_slots[exact])
        return filled, exact, exact_batch
