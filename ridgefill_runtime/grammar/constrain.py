"""The runner's structured-output state: one grammar matcher per constrained sequence.

Like a sequence's random generator, a matcher is sampler state: the runner keeps it (by
sequence id) and drops it when the sequence ends; the scheduler never sees it. A step masks
every constrained row in one call (the matchers' masks are computed in parallel, off the GIL,
and applied as one tensor operation), and afterwards each matcher consumes its sequence's new
token. A sequence whose grammar is complete ends with "stop"; one whose grammar allows no
token at all ends with "grammar_error" and gets no token.
"""

from __future__ import annotations

import llguidance
import torch

from .book import GrammarBook
from .masks import apply_masks, mask_words, unpack_bitmask

GRAMMAR_ERROR = "grammar_error"  # the finish reason of a sequence whose grammar allows no token


class Constrainer:
    def __init__(self, book: GrammarBook, rows: int, threads: int | None = None):
        """`rows`: the model's logit rows (at least the tokenizer's tokens)."""
        self.book = book
        self.rows = rows
        self._threads = threads
        self._matchers: dict[int, llguidance.LLMatcher] = {}
        self._executor: llguidance.LLExecutor | None = None

    def any_constrained(self, items) -> bool:
        return any(_constrained(item) for item in items)

    def mask(self, items, owners: list[tuple[int, int]], logits: torch.Tensor) -> set[int]:
        """Mask the sampled row of every constrained item in logits [R, V] in place; returns
        the sequence ids whose grammar allows no token (they must sample nothing)."""
        picked = [(k, item) for k, item in enumerate(items) if _constrained(item)]
        if not picked:
            return set()
        for _, item in picked:
            if item.num_sampled != 1:  # NOTE: the engine gives constrained requests no drafts
                raise RuntimeError(f"sequence {item.seq.seq_id}: a constrained sequence verifies no drafts")
        matchers = [self._matcher(item.seq) for _, item in picked]
        words = mask_words(self.book.vocab_size)
        bitmask = torch.zeros(len(picked), words, dtype=torch.int32)  # [n, words]
        self._pool().unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), words * 4, len(picked)
        )
        allowed = unpack_bitmask(bitmask, self.book.vocab_size, logits.shape[-1])  # [n, V]
        # NOTE: a matcher in its error state still allows the end-of-text token; it has no valid continuation
        errored = [i for i, m in enumerate(matchers) if m.is_error()]
        if errored:
            allowed[errored] = False
        allowed = allowed.to(logits.device)
        rows = torch.tensor([owners[k][1] - 1 for k, _ in picked], device=logits.device)
        with torch.inference_mode():  # NOTE: the step's logits are an inference tensor
            apply_masks(logits, rows, allowed)
        dead = (~allowed.any(-1)).tolist()
        return {item.seq.seq_id for (_, item), d in zip(picked, dead) if d}

    def advance(self, items, next_tokens: list[list[int] | None], dead: set[int]) -> dict[int, str]:
        """Each constrained sequence's matcher consumes its new token; returns {sequence id:
        finish reason} for those the grammar ends."""
        ended: dict[int, str] = {}
        for item, run in zip(items, next_tokens):
            seq = item.seq
            if not _constrained(item):
                continue
            if seq.seq_id in dead:
                ended[seq.seq_id] = GRAMMAR_ERROR
                continue
            if not run:
                continue
            matcher = self._matchers[seq.seq_id]
            if not matcher.consume_tokens(run):
                ended[seq.seq_id] = GRAMMAR_ERROR
            elif matcher.is_stopped():
                ended[seq.seq_id] = "stop"
        return ended

    def forget(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)

    def _matcher(self, seq) -> llguidance.LLMatcher:
        matcher = self._matchers.get(seq.seq_id)
        if matcher is None:
            matcher = self._matchers[seq.seq_id] = self.book.matcher(seq.params.grammar)
        return matcher

    def _pool(self) -> llguidance.LLExecutor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=self._threads)
        return self._executor


def _constrained(item) -> bool:
    params = item.seq.params
    return item.samples and params.grammar is not None and params.max_tokens > 0
