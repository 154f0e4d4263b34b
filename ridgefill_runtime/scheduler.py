"""Decides what runs each step: continuous batching under a token budget, chunked prefill,
preemption (recompute) of the newest sequences when the KV blocks run out.

Plain Python over Sequence objects and cache ids (blocks, state slots) kept by the cache
manager it owns; no tensors, no model code.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .cache.manager import CacheManager
from .config import SchedulerConfig
from .sequence import Sequence, SeqStatus, TokenLogprobs
from .speculative import Propose, draft_limit, no_drafts
from .stages import ScheduledSeq, Select, Stage, advance, next_item, resume_from_cache, usable_hit

__all__ = ["Scheduler", "ScheduledSeq", "SpecCounts", "StepResult"]


@dataclass(frozen=True)
class StepResult:
    """What the runner hands back, as plain Python values, one entry per scheduled item."""

    # per item, its new tokens in order: a run of one sampled token, or a verified draft's
    # accepted run (None: the item samples nothing, or its sequence keeps none: max_tokens == 0)
    next_tokens: list[list[int] | None]
    # (first position, logp, argmax), and with params.prompt_top_logprobs each row's top pairs
    prompt_logprobs: list[tuple | None]
    row_scores: list[dict[str, list[float]] | None] | None = None  # selector scores per prefix row
    # seq_id -> one entry per token of its run, for sequences asking params.logprobs
    token_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    # seq_id -> the finish reason of a sequence its grammar ended this step ("stop": complete;
    # "grammar_error": nothing allowed, and then no token in next_tokens)
    ended: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.prompt_logprobs) != len(self.next_tokens):
            raise ValueError(
                f"a step result has {len(self.next_tokens)} token entries, {len(self.prompt_logprobs)} prompt scores"
            )
        for run in self.next_tokens:
            if run is not None and not isinstance(run, list):
                raise TypeError(f"an item's new tokens are a list (a run) or None, got {type(run).__name__}")

    def token(self, k: int) -> int | None:
        """Item k's first new token (all there is without speculation), or None."""
        run = self.next_tokens[k]
        return run[0] if run else None


def _no_selection(seq: Sequence) -> list[int]:
    return []


class Scheduler:
    """Liveness by construction: a running sequence that cannot grow preempts the newest running
    ones (never an older one), and one request alone always fits (Engine.validate bounds
    prompt + max_tokens by the pool). So the oldest running sequence never loses its work, and
    every step schedules something while there is work."""

    def __init__(
        self,
        config: SchedulerConfig,
        caches: CacheManager,
        select: Select = _no_selection,
        propose: Propose = no_drafts,
    ):
        """`caches`: the manager of every cache's ids (ModelCaches.manager(), or a bare
        CacheManager with no pools behind it: the fake-runner tests). `propose` drafts tokens
        for sequences that speculate (seq.spec.max_draft > 0)."""
        self.config = config
        self.caches = caches
        self.blocks = caches.blocks
        self.select = select  # chooses a filled sequence's exact prefix rows after its lower sweep
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first: the order of admission
        self.num_preemptions = 0
        self.spec = SpecCounts()
        self.propose = propose

    # -- admission and removal ------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.start_prefill()
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence wherever it is and give back everything it holds."""
        if seq.finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.caches.free(seq)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason

    def expire(self, now: float) -> list[Sequence]:
        """End every sequence whose deadline is at or before `now` ("timeout"); returns them."""
        late = [s for s in (*self.running, *self.waiting) if s.deadline is not None and s.deadline <= now]
        for seq in late:
            self.finish(seq, "timeout")
        return late

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ------------------------------------------------------------------------

    def schedule(self) -> list[ScheduledSeq]:
        """This step's items. Never empty while there is work and one request fits the pool."""
        step = _Step(self.config.max_num_batched_tokens)
        # NOTE: decodes first, so a long prompt never delays running users by more than
        # the chunk it is given in the same step.
        for seq in [s for s in self.running if _decoding(s)]:
            if self._may_run(step, seq):
                self._run(step, self._decode_item(seq, step))
        cap = self.config.prefill_budget_with_decodes
        if cap and step.items:  # NOTE: prompt rows past the cap would stall every decode of the step
            step.budget = min(step.budget, cap)
        for seq in [s for s in self.running if not _decoding(s)]:
            if self._may_run(step, seq):
                self._run(step, next_item(seq, step.budget, self.config.chunk_size, self.caches.snapshot_stop(seq)))
        # NOTE: a step that had to preempt is short of blocks: admitting now would only take
        # blocks an older sequence asks back next step (wasted prefill).
        if not step.preempted:
            self._admit(step)
        for item in step.items:  # NOTE: once no item can be dropped any more
            self.caches.plan_state(item)
        return step.items

    @staticmethod
    def _may_run(step: _Step, seq: Sequence) -> bool:
        # NOTE: seq may have been preempted earlier in this step to make room for an older one.
        return step.budget > 0 and seq.status is SeqStatus.RUNNING

    def _run(self, step: _Step, item: ScheduledSeq) -> None:
        if not self._make_room(item, step):
            return
        if item.kind is Stage.RECOVER and item.seq.fill.queue_done == 0 and not self._own_remade_blocks(item, step):
            return
        step.add(item)

    def _own_remade_blocks(self, item: ScheduledSeq, step: _Step) -> bool:
        """The blocks holding the rows a reselecting sequence remakes came from the prefix cache:
        it makes them its own before the first of them runs, copying those others hold too
        (preempting the newest running sequences for the room); False when seq gave way itself.
        NOTE: alone, it holds them alone and needs no copy, so it always runs in the end."""
        seq = item.seq
        indices = sorted({r // self.blocks.block_size for r in seq.fill.queue})  # NOTE: the rows it recovers
        if not self._preempt_until(seq, step, lambda: self.blocks.num_free >= self.caches.copies_needed(seq, indices)):
            return False
        item.copies = self.caches.make_private(seq, indices)
        return True

    def _decode_item(self, seq: Sequence, step: _Step) -> ScheduledSeq:
        """One decode row, plus the draft it verifies when seq speculates. NOTE: a draft is
        optional work: it takes only budget and blocks that are free now and never preempts."""
        limit = min(draft_limit(seq), step.budget - 1)
        draft = self.propose(seq, limit)[:limit] if limit > 0 else []
        if draft and not self._draft_fits(seq, len(draft)):
            draft = []
        return ScheduledSeq(seq, seq.num_computed, 1 + len(draft), draft=draft)

    def _draft_fits(self, seq: Sequence, num_draft: int) -> bool:
        """The draft's extra blocks are free beyond what every running sequence (seq included)
        still needs for its known tokens, so no decode this step is short for a draft."""
        extra = self.caches.blocks_needed(seq, seq.num_tokens + num_draft) - self.caches.blocks_needed(
            seq, seq.num_tokens
        )
        return extra == 0 or extra + self._blocks_owed() <= self.blocks.num_free

    def _make_room(self, item: ScheduledSeq, step: _Step) -> bool:
        """Take what the item needs (its table grown to item.end, late window pages), preempting
        the newest running sequences until it fits; False when its sequence was the newest left
        and gave way itself."""
        if not self._preempt_until(item.seq, step, lambda: self.caches.can_run(item)):
            return False
        self.caches.prepare(item)
        return True

    def _preempt_until(self, seq: Sequence, step: _Step, fits) -> bool:
        """Preempt the newest running sequences until `fits()`; False when seq itself gave way."""
        while not fits():
            victim = self.running[-1]  # at or after seq in admission order: never an older one
            self._preempt(victim)
            step.drop(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, step: _Step) -> None:
        """Start waiting sequences (oldest first) while the pool holds their whole known tokens
        on top of what the running ones still need, so prefills never fight over blocks."""
        while self.waiting and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hit = self.caches.match(seq, usable_hit)
            if hit.waits or not self.caches.can_allocate(seq, seq.num_tokens, self._blocks_owed(), hit):
                break
            resume_from_cache(seq, hit)
            item = next_item(seq, step.budget, self.config.chunk_size, self.caches.snapshot_stop(seq))
            self.waiting.popleft()
            self.caches.allocate(seq, item.end, hit)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            step.add(item)

    def _blocks_owed(self) -> int:
        """Blocks the running sequences still need to hold every token they know of."""
        return sum(self.caches.blocks_needed(s, s.num_tokens) for s in self.running)

    def _preempt(self, seq: Sequence) -> None:
        # NOTE: recompute, not swap: its tokens are kept, its K/V, states and stash are given
        # back now (memory is short) and rebuilt by a new prefill. It goes to the front of the
        # queue; victims are taken newest first, so the queue keeps admission order.
        self.running.remove(seq)
        self.caches.preempt(seq)
        seq.start_prefill()
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, items: list[ScheduledSeq], result: StepResult, eos_ids: tuple[int, ...]) -> list[Sequence]:
        """Apply a step's results; returns the sequences that gained a token or finished."""
        touched = []
        row_scores = result.row_scores or [None] * len(items)
        for item, tokens, scored, rs in zip(items, result.next_tokens, result.prompt_logprobs, row_scores):
            seq = item.seq
            if seq.finished:  # aborted while the step ran
                continue
            advance(item, rs, self.select)
            self.caches.settle(seq)
            if scored is not None:
                _record_prompt_scores(seq, *scored)
            if not item.samples:  # a prefill chunk: what it finished may serve others at once
                self.caches.publish(seq)
                continue
            touched.append(seq)
            ended = result.ended.get(seq.seq_id)
            if not tokens:  # max_tokens == 0: a scoring request ends after its prefill
                self.finish(seq, ended or "length")
                continue
            appended = self._append_run(seq, tokens, eos_ids)
            seq.logprobs.output.extend(result.token_logprobs.get(seq.seq_id, ())[:appended])
            if item.draft:
                self._settle_draft(item, appended)
            if ended is not None and not seq.finished:
                self.finish(seq, ended)
            if not seq.finished:  # NOTE: after a rollback, so rejected draft rows are never published
                self.caches.publish(seq)
        for item in items:  # NOTE: after any rollback: a rejected draft row is run again
            self.caches.trim(item.seq)
            self.caches.publish_state(item)
        return touched

    def _append_run(self, seq: Sequence, tokens: list[int], eos_ids: tuple[int, ...]) -> int:
        """Append the step's tokens in order, up to the first that ends the sequence (a stop
        token or EOS inside an accepted run ends it there; max_tokens is never passed)."""
        for n, token in enumerate(tokens, 1):
            seq.output_ids.append(token)
            reason = _finish_reason(seq, token, eos_ids)
            if reason:
                self.finish(seq, reason)
                return n
        return len(tokens)

    def _settle_draft(self, item: ScheduledSeq, appended: int) -> None:
        """Count the verification and roll back what was rejected: K/V is valid for the last
        known token and the accepted drafts only; blocks past the known tokens go back."""
        seq = item.seq
        self.spec.steps += 1
        seq.spec.verifications += 1
        seq.spec.verified_tokens += appended
        self.spec.proposed += len(item.draft)
        self.spec.accepted += max(appended - 1, 0)
        self.spec.all_accepted += appended == len(item.draft) + 1
        if seq.finished:  # everything it held is already given back
            return
        seq.num_computed = seq.num_tokens - 1
        # NOTE: rows 0..appended-1 of the item (the last known token, the accepted drafts) stand
        self.caches.rollback(seq, seq.num_computed, seq.num_tokens, verified_row=appended - 1)


@dataclass
class SpecCounts:
    """Speculative decoding so far: verification items, drafts proposed and accepted."""

    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    all_accepted: int = 0  # verifications that accepted every draft (the others rejected one)


@dataclass
class _Step:
    """The step being built: its items and the token budget they leave."""

    budget: int
    items: list[ScheduledSeq] = field(default_factory=list)
    preempted: bool = False

    def add(self, item: ScheduledSeq) -> None:
        self.items.append(item)
        self.budget -= item.num_tokens

    def drop(self, seq: Sequence) -> None:
        """seq was preempted: take back any item it already has in this step."""
        self.preempted = True
        kept = [it for it in self.items if it.seq is not seq]
        self.budget += sum(it.num_tokens for it in self.items) - sum(it.num_tokens for it in kept)
        self.items = kept


def _decoding(seq: Sequence) -> bool:
    return seq.fill.stage.done and seq.remaining == 1


def _record_prompt_scores(
    seq: Sequence, start: int, logprobs: list[float], argmax: list[int], top: list | None = None
) -> None:
    # NOTE: rows are recorded from the fill boundary on (filled rows have no logits);
    # after a preemption the prompt is recomputed, so keep only rows not yet recorded.
    skip = len(seq.logprobs.prompt) - (start - seq.fill.boundary)
    if skip < len(logprobs):
        seq.logprobs.prompt.extend(logprobs[max(skip, 0) :])
        seq.logprobs.prompt_argmax.extend(argmax[max(skip, 0) :])
        if top is not None:
            seq.logprobs.prompt_top.extend(top[max(skip, 0) :])


def _finish_reason(seq: Sequence, token: int, eos_ids: tuple[int, ...]) -> str | None:
    p = seq.params
    if (token in eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
        return "stop"
    if len(seq.output_ids) >= p.max_tokens:
        return "length"
    return None
