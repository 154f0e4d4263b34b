"""Full logits of a prompt's exactly computed rows, through the engine's own runner (one
SequenceDriver per prompt): for the evaluation tools and tests, which need whole distributions,
not sampled tokens."""

from __future__ import annotations

import torch

from .cache.spec import spec_of
from .config import FillConfig, RowsConfig
from .engine import apply_fill, carries_late_state
from .fill.select import RowSelector
from .runner import Runner
from .sequence import SamplingParams, Sequence
from .sequence_driver import BLOCK_SIZE, SequenceDriver
from .stages import Stage, advance, next_item


class PromptLogits:
    def __init__(
        self,
        model,
        fill: FillConfig | None = None,
        maps=None,
        chunk: int = 512,
        block_size: int = BLOCK_SIZE,
        selector: RowSelector | None = None,
    ):
        self.model, self.fill, self.maps = model, fill or FillConfig(), maps
        self.chunk, self.block_size = chunk, block_size
        self.select = selector or RowSelector(None)

    def new_sequence(self, ids: list[int], rows: RowsConfig | None = None, hide_from: int | None = None) -> Sequence:
        seq = Sequence(prompt_ids=list(ids), params=SamplingParams(max_tokens=0, prompt_logprobs=True))
        apply_fill(
            seq,
            self.fill,
            True,
            rows,
            hide_from,
            self.fill.enabled and carries_late_state(spec_of(self.model), self.fill.split),
        )
        seq.start_prefill()
        return seq

    def __call__(
        self,
        ids: list[int],
        after_fill=None,
        logits_from: int = 0,
        rows: RowsConfig | None = None,
        hide_from: int | None = None,
        at_prefix_end=None,
    ) -> tuple[int, torch.Tensor, Runner, Sequence]:
        """-> (first row with logits, logits [N - first, V], the runner holding the cache, the sequence).

        Logits start at the fill boundary, or at `logits_from` (whichever is later).
        after_fill(runner, seq), if given, runs once the prefix is filled and before any late
        layer reads it (the splice measurements edit the filled cache there). at_prefix_end(runner,
        seq), on a hybrid, runs once the late sweep has carried the recurrent states to the prefix's
        end, before any tail row reads them (the state splice replaces them there)."""
        seq = self.new_sequence(ids, rows, hide_from)
        # NOTE: a splice edits every filled row's late K/V, so every one must be written first
        drive = SequenceDriver(
            self.model, seq, self.fill, self.maps, block_size=self.block_size, defer_windows=after_fill is None
        )
        runner = drive.runner
        first = max(seq.fill.boundary, logits_from)
        scoring, silent = seq.params, SamplingParams(max_tokens=0)
        parts, hooked = [], after_fill is None or seq.fill.boundary == 0
        while not seq.fill.stage.done or seq.num_computed < len(ids):
            if not hooked and not seq.fill.stage.from_tokens:  # NOTE: the probe or the late sweep is next
                after_fill(runner, seq)
                hooked = True
            item = next_item(seq, self.chunk, self.chunk)
            if item.kind is Stage.FULL and item.start < first < item.end:
                item.num_tokens = first - item.start  # NOTE: rows before `first` need no logits
            seq.params = scoring if item.end > first else silent
            step = drive.forward(item)
            advance(item, step.row_scores[0], self.select)
            if at_prefix_end is not None and item.kind is Stage.LATE and item.end == seq.fill.boundary:
                at_prefix_end(runner, seq)  # NOTE: a hybrid's late chunks end there (stages.next_item)
            drive.settle()
            if item.kind.reaches_top and item.end > first:
                logits = step.logits
                parts.append(logits[max(0, logits.shape[0] - (item.end - first)) :])
        seq.params = scoring
        return first, torch.cat(parts), runner, seq
