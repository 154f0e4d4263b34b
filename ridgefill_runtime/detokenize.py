"""Output text for a sequence: incremental decoding, stop strings, safe streaming deltas."""

from __future__ import annotations

from .sequence import Sequence

_REPLACEMENT = "\ufffd"


class TextTracker:
    """Keeps each sequence's decoded text and how much of it has been handed out."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._emitted: dict[int, int] = {}

    def update(self, seq: Sequence) -> tuple[str, bool]:
        """Decode seq's output; returns (new text safe to emit, whether a stop string hit)."""
        if self.tokenizer is None:
            return "", False
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        hit = False
        for stop in seq.params.stop:
            at = text.find(stop)
            if at >= 0:
                text, hit = text[:at], True
        seq.text = text
        done = hit or seq.finished
        # NOTE: while running, hold back a trailing partial UTF-8 character and any suffix
        # that could still grow into a stop string, so streamed text never has to be taken back.
        safe = len(text) if done else _safe_length(text, seq.params.stop)
        start = self._emitted.get(seq.seq_id, 0)
        delta = text[start:safe] if safe > start else ""
        self._emitted[seq.seq_id] = max(start, safe)
        if done:
            self._emitted.pop(seq.seq_id, None)
        return delta, hit

    def forget(self, seq_id: int) -> None:
        """Drop a sequence that ended without a final update (aborted)."""
        self._emitted.pop(seq_id, None)


def _safe_length(text: str, stops: tuple[str, ...]) -> int:
    n = len(text)
    while n and text[n - 1] == _REPLACEMENT:
        n -= 1
    held = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, n), 0, -1):
            if text[n - k : n] == stop[:k]:
                held = max(held, k)
                break
    return n - held
