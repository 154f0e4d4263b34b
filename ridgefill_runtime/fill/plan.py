"""Runner-side: turn a step's scheduled items into a FillStep (or None when no fill applies)."""

from __future__ import annotations

import torch

from ..config import FillConfig
from ..layers.attention import AttentionBatch
from .step import FillStep, Predictor, Rescale


def is_fill_item(item) -> bool:
    """All of this item's rows lie before its sequence's fill boundary (they never straddle it)."""
    return item.end <= item.seq.fill_boundary


def build_fill_step(items, batch: AttentionBatch, slots_of, config: FillConfig,
                    predict: Predictor | None) -> FillStep | None:
    """slots_of(seq, start, end) -> cache slots [end - start] of the sequence's positions."""
    fill_seqs = [it for it in items if it.seq.fill_boundary > 0]
    needs = any(is_fill_item(it) or it.seq.fill_arm == "nofill" or _first_tail(it, config) for it in fill_seqs)
    if not needs:
        return None  # NOTE: decode over a ridge/identity-filled cache is an ordinary step
    fill_rows, late_rows, late_starts, late_read, late_ctx, rescales = [], [], [0], [], [], []
    for k, item in enumerate(items):
        lo, hi = batch.query_starts[k], batch.query_starts[k + 1]
        rows = torch.arange(lo, hi)
        if is_fill_item(item):
            fill_rows.append(rows)
            continue
        seq = item.seq
        if seq.fill_boundary and _first_tail(item, config):
            c = min(config.rescale_rows, item.num_tokens)
            rescales.append(Rescale(rows=torch.arange(late_starts[-1], late_starts[-1] + c),
                                    filled_slots=slots_of(seq, 0, seq.fill_boundary),
                                    values=config.value_rescale, keys=config.key_rescale))
        late_rows.append(rows)
        late_starts.append(late_starts[-1] + item.num_tokens)
        late_ctx.append(item.end)
        if seq.fill_boundary and seq.fill_arm == "nofill":
            # NOTE: no fill: the late layers of this sequence never see its prefix.
            late_read.append(slots_of(seq, seq.fill_boundary, item.end))
        else:
            late_read.append(batch.read_slots[k])
    cat = lambda xs: torch.cat(xs) if xs else torch.empty(0, dtype=torch.int64)  # noqa: E731
    f_rows, l_rows = cat(fill_rows), cat(late_rows)
    dev = batch.write_slots.device
    late_batch = AttentionBatch(query_starts=late_starts, context_lens=late_ctx,
                                write_slots=batch.write_slots[l_rows.to(dev)], read_slots=late_read)
    return FillStep(split=config.split, rows=f_rows.to(dev), slots=batch.write_slots[f_rows.to(dev)],
                    predict=predict, late_rows=l_rows.to(dev), late_batch=late_batch, rescales=rescales)


def _first_tail(item, config: FillConfig) -> bool:
    """The step holding a filled sequence's first tail rows measures and applies the rescale."""
    return (item.start == item.seq.fill_boundary and item.seq.fill_arm in ("identity", "ridgefill")
            and (config.value_rescale or config.key_rescale))
