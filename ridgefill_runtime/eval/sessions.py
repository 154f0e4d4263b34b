"""One prompt's lower sweep, shared by every exact-row selection evaluated on it.

The lower sweep (layers below the split for every row, the prefix's late K/V filled) does not
depend on which rows are later chosen, so an evaluation runs it once per prompt and split,
keeps a snapshot, and runs each selection's probe, late sweep and answer from that snapshot.
The steps are the runner's and the stages' own (stages.py), so what is measured is what the
server runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import FillConfig, RowsConfig
from ..engine import apply_fill
from ..layers.attention import kv_slots
from ..fill.select import RowSelector
from ..cache.split_stash import SplitStash
from ..sequence import SamplingParams, Sequence
from ..sequence_driver import SequenceDriver
from ..stages import ScheduledSeq, Stage, advance, finish_lower, next_item

CHUNK = 2048  # NOTE: big chunks: the CPU's masked-attention path for later chunks is slower


@dataclass
class Outcome:
    exact_rows: list[int]
    output_ids: list[int]  # greedy answer (generate mode)
    tail_logits: torch.Tensor | None  # [T, V] (score mode)


class PromptSession:
    """Lower sweep once (with the lower-layer attention recorded), then any selection."""

    def __init__(
        self,
        model,
        fill: FillConfig,
        maps,
        selector: RowSelector,
        ids: list[int],
        hide_from: int | None = None,
        max_new: int = 0,
        chunk: int = CHUNK,
    ):
        self.model, self.fill, self.selector, self.chunk = model, fill, selector, chunk
        seq = Sequence(prompt_ids=list(ids), params=SamplingParams(max_tokens=0))
        # NOTE: the attention selector's scores are recorded whatever the arms are
        apply_fill(seq, fill, True, fill.rows.replace(selectors=("attention",)), hide_from)
        seq.start_prefill()
        self.drive = SequenceDriver(model, seq, fill, maps, max_tokens=len(ids) + max_new)
        self.runner, self.seq = self.drive.runner, seq
        while seq.num_computed < seq.num_tokens:  # NOTE: not advance(): the selection happens per arm
            item = next_item(seq, chunk, chunk)
            step = self.drive.forward(item)
            seq.num_computed = item.end
            seq.fill.row_scores.update(step.row_scores[0] or {})
        self._late_kv = self._read_late_kv()
        stash = self.runner.stash(seq)
        self._x = stash.x.clone()
        self._scores = dict(seq.fill.row_scores)

    def _prompt_slots(self) -> torch.Tensor:
        """Cache slots [N] of the prompt's positions."""
        seq, block_size = self.seq, self.drive.caches.block_size
        table = torch.tensor(seq.block_table, dtype=torch.int64)
        return kv_slots(table, torch.arange(seq.num_tokens), block_size).to(self.model.device)

    def _read_late_kv(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The prompt's K/V [N, Hkv, D] at every attention layer from the split on, as the lower
        sweep left them. NOTE: a run's decode writes each later position before any row reads it,
        so those need no snapshot."""
        kv, slots = self.drive.caches.kv, self._prompt_slots()
        late = [i for i in self.drive.caches.spec.attention_layers if i >= self.fill.split]
        return {i: kv.read(i, slots) for i in late}

    def run(self, rows: RowsConfig, max_new: int = 0, score: bool = False, done=None) -> Outcome:
        """Restore the snapshot, choose rows with `rows`, run probe + late sweep, then either
        generate up to max_new greedy tokens (stopping early once done(tokens) holds) or return
        the tail rows' logits."""
        seq, runner = self._restore(rows, score)
        finish_lower(seq, self.selector)
        logits = []
        first = None
        while not seq.fill.stage.done:
            item = next_item(seq, self.chunk, self.chunk)
            if item.samples and not score:
                result = self.drive.run(item)
                first = result.token(0)
                advance(item, result.row_scores[0], self.selector)
                continue
            step = self.drive.forward(item)
            if score and item.kind is Stage.LATE:
                logits.append(step.logits)
            advance(item, step.row_scores[0], self.selector)
        runner.states.drop_stash(seq.state_slot)  # NOTE: the late sweep is over, as in the engine
        outputs = [] if first is None else [first]
        while len(outputs) < max_new and not (done and done(outputs)):
            seq.output_ids = list(outputs)
            item = ScheduledSeq(seq, seq.num_computed, 1)
            outputs.append(self.drive.run(item).token(0))
            seq.num_computed += 1
        seq.output_ids = []
        return Outcome(list(seq.fill.exact_rows), outputs, torch.cat(logits) if score else None)

    def _restore(self, rows: RowsConfig, score: bool):
        seq, runner = self.seq, self.runner
        kv, slots = self.drive.caches.kv, self._prompt_slots()
        for i, (k, v) in self._late_kv.items():
            kv.write(i, slots, k, v)
        # NOTE: the last run's late sweep dropped the stash; put a fresh copy of the snapshot back
        stash = SplitStash.new(seq.num_tokens, self._x.shape[1], seq.fill.boundary, self._x.dtype, self._x.device)
        stash.x.copy_(self._x)
        runner.put_stash(seq, stash)
        seq.fill.rows, seq.fill.row_scores = rows, dict(self._scores)
        seq.num_computed, seq.output_ids = seq.num_tokens, []
        seq.params = SamplingParams(max_tokens=1 << 20, temperature=0, ignore_eos=True, prompt_logprobs=score)
        return seq, runner


def exact_answer(model, ids: list[int], max_new: int, chunk: int = 8192, done=None) -> list[int]:
    """Greedy tokens of the exact model, through the same runner (stopping once done(tokens))."""
    seq = Sequence(prompt_ids=list(ids), params=SamplingParams(max_tokens=1 << 20, temperature=0, ignore_eos=True))
    seq.start_prefill()
    drive = SequenceDriver(model, seq, max_tokens=len(ids) + max_new)
    while len(seq.output_ids) < max_new and not (done and seq.output_ids and done(seq.output_ids)):
        item = next_item(seq, chunk, chunk)
        token = drive.run(item).token(0)
        seq.num_computed = item.end
        if item.samples:
            seq.output_ids.append(token)
    return seq.output_ids
