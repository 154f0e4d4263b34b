"""Speculative decoding, the plain-Python parts: drafting tokens by n-gram (prompt) lookup and
choosing the accepted run from the target model's greedy choices. No tensors.

A decode step that verifies a draft runs the last known token and the k draft tokens as one
k+1-row item; row i's greedy choice is the model's next token after draft[:i]. The accepted
run is the longest draft prefix that matches those choices, plus the choice after it (the
"bonus" token), so a step yields 1..k+1 tokens and greedy output is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

from .config import SpeculativeConfig
from .sequence import Sequence

Propose = Callable[[Sequence, int], list[int]]  # (sequence, most drafts allowed) -> draft tokens


def no_drafts(seq: Sequence, limit: int) -> list[int]:
    return []


def ngram_draft(tokens: list[int], num_tokens: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The up to `num_tokens` tokens that followed the most recent earlier occurrence of the
    longest suffix of `tokens` (max_ngram down to min_ngram long); [] when none recurs."""
    n_all = len(tokens)
    if num_tokens <= 0:
        return []
    for n in range(min(max_ngram, n_all - 1), min_ngram - 1, -1):
        suffix = tokens[n_all - n :]
        # NOTE: newest match first: the nearest copy is the likeliest to continue the same way
        # (an edit of code repeats the lines just above, not a far older mention).
        for start in range(n_all - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + num_tokens]
    return []


class NgramProposer:
    """Propose for the scheduler: drafts from the sequence's own prompt and output."""

    def __init__(self, config: SpeculativeConfig):
        self.max_ngram, self.min_ngram = config.max_ngram, config.min_ngram

    def __call__(self, seq: Sequence, limit: int) -> list[int]:
        return ngram_draft(seq.prompt_ids + seq.output_ids, limit, self.max_ngram, self.min_ngram)


def self_draft_slots(seq: Sequence, limit: int) -> list[int]:
    """A looped model drafts with its own first loops (Algorithm 1), in the runner, once the step's
    batch is known: the scheduler reserves the rows and blocks with placeholders it never reads."""
    return [0] * limit


def accept_greedy(draft: list[int], choices: list[int]) -> list[int]:
    """The accepted run: `choices` (the greedy token after each of the len(draft) + 1 rows)
    up to and including the first one that disagrees with the draft."""
    assert len(choices) == len(draft) + 1, "one choice per verified row"
    matched = 0
    while matched < len(draft) and draft[matched] == choices[matched]:
        matched += 1
    return choices[: matched + 1]


def draft_limit(seq: Sequence) -> int:
    """Most drafts seq may verify now: its own setting, and never so many that the accepted
    run (drafts + bonus) could pass max_tokens. That also keeps it within the positions
    Engine.validate reserved (prompt + max_tokens - 1), so a lone request still fits."""
    left = seq.params.max_tokens - len(seq.output_ids)
    return max(0, min(seq.spec.max_draft, left - 1))
