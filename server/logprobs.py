"""The engine's log-probabilities (TokenLogprobs, a sequence's prompt scores) in OpenAI's two
shapes: the completions one (tokens, token_logprobs, top_logprobs, text_offset) and the chat one
(content: [{token, logprob, bytes, top_logprobs}]).

Every value is log_softmax of the model's raw logits (before temperature, top-k or top-p), as
the engine records it. The plain and the streamed answers are both built here, chunk by chunk,
so a stream's pieces add up to the plain answer.
"""

from __future__ import annotations

import codecs
import math
from functools import lru_cache

from ridgefill_runtime.sequence import TokenLogprobs

from .protocol import ChatTokenLogprob, CompletionLogprobs, TopLogprob

# JSON has no -Infinity; a logprob this low means "never" all the same.
LOGPROB_FLOOR = -9999.0


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


class TokenStrings:
    """Each token's text and bytes for one tokenizer, cached (the same ids recur in every
    answer). A byte-level BPE token may hold part of a UTF-8 character: its text is then
    U+FFFD, and only its bytes say what it is."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._byte_level = type(getattr(tokenizer.backend, "decoder", None)).__name__ == "ByteLevel"
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _bytes(self, token_id: int) -> bytes:
        text = self.text(token_id)
        if "\ufffd" not in text:
            return text.encode("utf-8")
        piece = self.tokenizer.id_to_token(token_id) or ""
        if self._byte_level and all(ch in _UNICODE_TO_BYTE for ch in piece):
            return bytes(_UNICODE_TO_BYTE[ch] for ch in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
            return bytes([int(piece[3:5], 16)])
        return text.encode("utf-8")

    def is_special(self, token_id: int) -> bool:
        return token_id in self.tokenizer.special_ids


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE writes each byte as one printable character: the printable Latin-1 bytes
    as themselves, the other 68 (controls, space, a few) as U+0100 onwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


_UNICODE_TO_BYTE = _byte_level_alphabet()


class TextOffsets:
    """Where each token's text starts in a text decoded from the tokens' bytes. An incremental
    UTF-8 decoder holds a split character's first bytes back, so a token that starts inside a
    character gets that character's offset, as the decoded text has it."""

    def __init__(self, strings: TokenStrings, start: int = 0, skip_special: bool = True):
        self.strings, self.at, self.skip_special = strings, start, skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def next(self, token_id: int) -> int:
        """The offset of this token, then move past it."""
        here = self.at
        if not (self.skip_special and self.strings.is_special(token_id)):  # the text leaves them out
            self.at += len(self._decoder.decode(self.strings.bytes(token_id)))
        return here


class CompletionLogprobsBuilder:
    """One completion choice's logprobs, piece by piece: the echoed prompt's, then each chunk's
    generated tokens, with text offsets running on over the whole choice text."""

    def __init__(self, strings: TokenStrings, generated_from: int):
        """`generated_from`: where the generated text starts in the choice text (the echoed
        prompt's length, or 0)."""
        self.strings = strings
        self._offsets = TextOffsets(strings, generated_from)

    def prompt(self, prompt_ids: list[int], logprobs: list[float], top: list[tuple]) -> CompletionLogprobs:
        """The echoed prompt's tokens: the first has no logprob (nothing precedes it); rows the
        engine did not score (the request ended before its prefill did) are null too."""
        offsets = TextOffsets(self.strings, 0, skip_special=False)  # NOTE: the echoed prompt keeps them
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for i, token in enumerate(prompt_ids):
            out.tokens.append(self.strings.text(token))
            out.text_offset.append(offsets.next(token))
            row = i - 1  # row i - 1 predicted token i
            if 0 <= row < len(logprobs):
                out.token_logprobs.append(finite(logprobs[row]))
                out.top_logprobs.append(self._top(top[row] if row < len(top) else (), token, logprobs[row]))
            else:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
        return out

    def generated(self, entries: list[TokenLogprobs]) -> CompletionLogprobs:
        return CompletionLogprobs(
            tokens=[self.strings.text(e.token) for e in entries],
            token_logprobs=[finite(e.logprob) for e in entries],
            top_logprobs=[self._top(e.top, e.token, e.logprob) for e in entries],
            text_offset=[self._offsets.next(e.token) for e in entries],
        )

    def _top(self, pairs: tuple, token: int, logprob: float) -> dict[str, float]:
        """The asked alternatives, best first, and the chosen token (OpenAI's "logprobs + 1").
        NOTE: two ids may share a text; the likelier one's value stands."""
        out: dict[str, float] = {}
        for alt, value in (*pairs, (token, logprob)):
            out.setdefault(self.strings.text(alt), finite(value))
        return out


def chat_content(strings: TokenStrings, entries: list[TokenLogprobs]) -> list[ChatTokenLogprob]:
    """Chat's logprobs.content for these generated tokens."""
    return [
        ChatTokenLogprob(
            **_top_entry(strings, e.token, e.logprob).model_dump(),
            top_logprobs=[_top_entry(strings, t, v) for t, v in e.top],
        )
        for e in entries
    ]


def _top_entry(strings: TokenStrings, token: int, logprob: float) -> TopLogprob:
    return TopLogprob(token=strings.text(token), logprob=finite(logprob), bytes=list(strings.bytes(token)))
