"""Decides what runs each step: continuous batching under a token budget, chunked prefill.

Plain Python over Sequence objects and block ids; no tensors, no model code.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .cache.block_manager import BlockManager
from .config import SchedulerConfig
from .sequence import Sequence, SeqStatus
from .stages import ScheduledSeq, Select, advance, next_item

__all__ = ["Scheduler", "ScheduledSeq", "StepResult"]


@dataclass
class StepResult:
    """What the runner hands back, as plain Python values, one entry per scheduled item."""

    next_tokens: list[int | None]
    prompt_logprobs: list[tuple[int, list[float], list[int]] | None]  # (first position, logp, argmax)
    row_scores: list[dict[str, list[float]] | None] | None = None  # selector scores per prefix row


def _no_selection(seq: Sequence) -> list[int]:
    return []


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, select: Select = _no_selection):
        self.config = config
        self.blocks = blocks
        self.select = select  # chooses a filled sequence's exact prefix rows after its lower sweep
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # -- admission and removal ------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.start_prefill()
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence wherever it is and give its blocks back."""
        if seq.finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.block_table)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ------------------------------------------------------------------------

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.config.max_num_batched_tokens
        items: list[ScheduledSeq] = []
        # NOTE: decodes first, so a long prompt never delays running users by more than
        # the chunk it is given in the same step.
        for seq in [s for s in self.running if _decoding(s)]:
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop to make room for an older one
            if not self._reserve(seq, 1):
                continue  # seq was preempted to make room
            items.append(ScheduledSeq(seq, seq.num_computed, 1))
            budget -= 1
        for seq in [s for s in self.running if not _decoding(s)]:
            if budget == 0:
                break
            item = next_item(seq, budget, self.config.chunk_size)
            if not self.blocks.can_grow(seq.block_table, item.end):
                break
            self.blocks.grow(seq.block_table, item.end)
            items.append(item)
            budget -= item.num_tokens
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            item = next_item(seq, budget, self.config.chunk_size)
            if not self.blocks.can_grow(seq.block_table, item.end):
                break
            self.waiting.popleft()
            self.blocks.grow(seq.block_table, item.end)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            items.append(item)
            budget -= item.num_tokens
        return items

    def _reserve(self, seq: Sequence, n: int) -> bool:
        """Make room for n more positions of a running seq, preempting the newest others."""
        while not self.blocks.can_grow(seq.block_table, seq.num_computed + n):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        self.blocks.grow(seq.block_table, seq.num_computed + n)
        return True

    def _preempt(self, seq: Sequence) -> None:
        # NOTE: recompute, not swap: its tokens are kept, its K/V are rebuilt by a new prefill.
        self.running.remove(seq)
        self.blocks.free(seq.block_table)
        seq.start_prefill()
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def postprocess(self, items: list[ScheduledSeq], result: StepResult,
                    eos_ids: tuple[int, ...]) -> list[Sequence]:
        """Apply a step's results; returns the sequences that gained a token or finished."""
        touched = []
        row_scores = result.row_scores or [None] * len(items)
        for item, token, scored, rs in zip(items, result.next_tokens, result.prompt_logprobs, row_scores):
            seq = item.seq
            if seq.finished:  # aborted while the step ran
                continue
            advance(item, rs, self.select)
            if scored is not None:
                _record_prompt_scores(seq, *scored)
            if not item.samples:
                continue
            touched.append(seq)
            if token is None:  # max_tokens == 0: a scoring request ends after its prefill
                self.finish(seq, "length")
                continue
            seq.output_ids.append(token)
            reason = _finish_reason(seq, token, eos_ids)
            if reason:
                self.finish(seq, reason)
        return touched


def _decoding(seq: Sequence) -> bool:
    return seq.stage == "full" and seq.remaining == 1


def _record_prompt_scores(seq: Sequence, start: int, logprobs: list[float], argmax: list[int]) -> None:
    # NOTE: rows are recorded from the fill boundary on (filled rows have no logits);
    # after a preemption the prompt is recomputed, so keep only rows not yet recorded.
    skip = len(seq.prompt_logprobs) - (start - seq.fill_boundary)
    if skip < len(logprobs):
        seq.prompt_logprobs.extend(logprobs[max(skip, 0):])
        seq.prompt_argmax.extend(argmax[max(skip, 0):])


def _finish_reason(seq: Sequence, token: int, eos_ids: tuple[int, ...]) -> str | None:
    p = seq.params
    if (token in eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
        return "stop"
    if len(seq.output_ids) >= p.max_tokens:
        return "length"
    return None
