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

    def mask(
        self, items, owners: list[tuple[int, int]], logits: torch.Tensor, drafts: dict[int, list[int]]
    ) -> set[int]:
        """Mask the sampled rows of every constrained item in logits [R, V] in place; returns the
        sequence ids whose grammar allows no token (they must sample nothing). An item verifying
        a draft (`drafts`: seq_id -> its draft) gets, on its row i, the mask after draft[:i]: the
        greedy choice there is the grammar's, so a draft token the grammar refuses is rejected."""
        picked = [(k, item) for k, item in enumerate(items) if _constrained(item)]
        if not picked:
            return set()
        plain = [(k, item) for k, item in picked if item.num_sampled == 1]
        verifying = [(k, item) for k, item in picked if item.num_sampled > 1]
        words = mask_words(self.book.vocab_size)
        bitmask = torch.zeros(sum(item.num_sampled for _, item in picked), words, dtype=torch.int32)  # [n, words]
        rows: list[int] = []
        matchers = [self._matcher(item.seq) for _, item in plain]
        if matchers:  # NOTE: every plain row in one call: llguidance computes them in parallel, off the GIL
            self._pool().unsafe_compute_mask_ptr(
                [(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), words * 4, bitmask.shape[0]
            )
        rows += [owners[k][1] - 1 for k, _ in plain]
        owner_rows = [(item.seq.seq_id, [i]) for i, (_, item) in enumerate(plain)]
        for k, item in verifying:
            draft = drafts.get(item.seq.seq_id, item.draft)
            first = len(rows)
            _draft_masks(self._matcher(item.seq), draft, bitmask[first : first + len(draft) + 1])
            rows += range(owners[k][1] - item.num_sampled, owners[k][1])
            owner_rows.append((item.seq.seq_id, list(range(first, first + len(draft) + 1))))
        allowed = unpack_bitmask(bitmask, self.book.vocab_size, logits.shape[-1])  # [n, V]
        # NOTE: a matcher in its error state still allows the end-of-text token; it has no valid continuation
        errored = [i for seq_id, at in owner_rows if self._matchers[seq_id].is_error() for i in at]
        if errored:
            allowed[errored] = False
        allowed = allowed.to(logits.device)
        with torch.inference_mode():  # NOTE: the step's logits are an inference tensor
            apply_masks(logits, torch.tensor(rows, device=logits.device), allowed)
        empty = (~allowed.any(-1)).tolist()
        return {seq_id for seq_id, at in owner_rows if empty[at[0]]}

    def advance(self, items, next_tokens: list[list[int] | None], dead: set[int]) -> dict[int, str]:
        """Each constrained sequence's matcher consumes its new tokens; returns {sequence id:
        finish reason} for those the grammar ends. A run that goes on past the grammar's end is
        cut there, in place."""
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
            for k, token in enumerate(run):
                if not matcher.consume_token(token):
                    ended[seq.seq_id] = GRAMMAR_ERROR
                    break
                if matcher.is_stopped():
                    # NOTE: an accepted draft run may go past the grammar's end (the row after it allows
                    # only the end of text): cut there, so speculation ends where one token at a time does
                    del run[k + 1 :]
                    ended[seq.seq_id] = "stop"
                    break
        return ended

    def draft_guide(self, items) -> DraftGuide | None:
        """The grammar's hand in a looped model's self-drafts this step, or None when no
        drafting item is constrained."""
        # NOTE: copies walk the drafts, so the sequences' own matchers stay where they are (see _draft_masks)
        drafting = {it.seq.seq_id: self._matcher(it.seq).deep_copy() for it in items if it.draft and _constrained(it)}
        return DraftGuide(drafting, self.book.vocab_size) if drafting else None

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


def _draft_masks(matcher: llguidance.LLMatcher, draft: list[int], into: torch.Tensor) -> None:
    """into [len(draft) + 1, words]: row i the mask after draft[:i]. Only the draft's prefix the
    grammar takes is walked (the verification rejects the rest at the first refused token, so
    the rows after it are never read: they repeat that row's mask). A copy walks it: rolling
    the matcher back across the end-of-text token that completes a grammar left it one token
    off, and the next step then refused the sequence's own accepted tokens."""
    words = into.shape[1]
    walker = matcher.deep_copy()
    taken = walker.validate_tokens(draft)
    for i in range(len(draft) + 1):
        if i <= taken:
            walker.unsafe_compute_mask_ptr(into[i].data_ptr(), words * 4)
            if i < taken:
                walker.consume_token(draft[i])
        else:
            into[i] = into[taken]


def _constrained(item) -> bool:
    params = item.seq.params
    return item.samples and params.grammar is not None and params.max_tokens > 0


class DraftGuide:
    """Masks a looped model's draft passes with each constrained sequence's grammar, so a draft
    is one the grammar allows (unguided, the draft loops write what the grammar refuses and the
    verification accepts almost nothing). Each matcher (a copy of the sequence's) walks its
    sequence's draft as it is written. Past the point
    where the grammar is complete or refuses a token, a row is left unmasked: the verification
    rejects that draft token anyway."""

    def __init__(self, matchers: dict[int, llguidance.LLMatcher], vocab_size: int):
        self._matchers = matchers
        self._vocab = vocab_size
        self._off: set[int] = set()  # sequences past the grammar's end or off it

    def mask(self, seq_ids: list[int], logits: torch.Tensor) -> None:
        """logits [len(seq_ids), V]: row k is seq_ids[k]'s next draft pass."""
        guided = [(k, i) for k, i in enumerate(seq_ids) if i in self._matchers and i not in self._off]
        if not guided:
            return
        words = mask_words(self._vocab)
        bitmask = torch.zeros(len(guided), words, dtype=torch.int32)  # [n, words]
        for row, (_, seq_id) in enumerate(guided):
            self._matchers[seq_id].unsafe_compute_mask_ptr(bitmask[row].data_ptr(), words * 4)
        allowed = unpack_bitmask(bitmask, self._vocab, logits.shape[-1]).to(logits.device)  # [n, V]
        empty = ~allowed.any(-1)
        allowed[empty] = True  # NOTE: a complete or dead grammar: any draft, the verification decides
        with torch.inference_mode():
            apply_masks(logits, torch.tensor([k for k, _ in guided], device=logits.device), allowed)

    def take(self, seq_ids: list[int], tokens: list[int]) -> None:
        """Each guided matcher consumes its sequence's new draft token."""
        for seq_id, token in zip(seq_ids, tokens):
            matcher = self._matchers.get(seq_id)
            if matcher is None or seq_id in self._off:
                continue
            if matcher.is_stopped() or not matcher.consume_token(token):
                self._off.add(seq_id)
