"""Per-token facts the exact-row rules need: each id's text, which ids are special, and how often
each id occurred in the calibration documents.

Everything here is plain Python over token ids, so the rules in `rules.py` run without torch and
can be tested on crafted vocabularies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping, Sequence

# Token types (as `Tokenizer.token_type` names them) whose rows are always computed exactly and
# that end a sentence: they carry no text of the document.
SPECIAL_TYPES = frozenset({"control", "user_defined", "unknown", "unused"})

COUNTS_FORMAT = "ridgefill-unigram/1"

# The classes `token_class` returns; `ELIGIBLE_CLASSES` are those the protected-token rule may pick
# (paper §2.4): lower-case word starts and numbers are left out because they are frequent and
# their K/V is predicted well; punctuation and whitespace carry no identifier.
TOKEN_CLASSES = ("cap_start", "cap_piece", "lower_start", "lower_piece", "number", "punct", "space", "mixed")
ELIGIBLE_CLASSES = frozenset({"cap_start", "cap_piece", "lower_piece", "mixed"})


@dataclass(frozen=True)
class TokenTable:
    """What the rules know about a vocabulary.

    pieces:  the text of each id decoded on its own. A byte-level BPE piece that holds part of a
             multi-byte character decodes to U+FFFD; the rules read it as a symbol.
    special: control, user-defined, unknown and unused ids (plus the tokenizer's own special ids).
    counts:  calibration unigram count of each id, or None when no counts were loaded.
    """

    pieces: tuple[str, ...]
    special: frozenset[int]
    counts: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.counts is not None and len(self.counts) != len(self.pieces):
            raise ValueError(f"counts has {len(self.counts)} entries but the vocabulary has {len(self.pieces)} ids")

    @classmethod
    def from_tokenizer(cls, tokenizer, counts: Sequence[int] | None = None) -> TokenTable:
        # A padded model's rows past the vocabulary (Tokenizer.for_model_rows) can be prompt ids:
        # they have no text and are `unused`, and the calibration never counted them.
        n = getattr(tokenizer, "decodable_ids", tokenizer.vocab_size)
        if counts is not None and len(counts) == tokenizer.vocab_size < n:
            counts = [*counts, *[0] * (n - tokenizer.vocab_size)]
        # One decode per id: ~0.05 s for a 49K vocabulary, and it gives exactly the text the
        # tokenizer would produce for that id alone (decode_batch gives the same, no faster).
        pieces = tuple(tokenizer.decode([i]) for i in range(n))
        special = {i for i in range(n) if tokenizer.token_type(i) in SPECIAL_TYPES}
        # bos/eos/pad/unk and backend-special ids are control tokens in every vocabulary we load;
        # the union keeps this set equal to the one the map fit leaves out (fitting.kept_rows).
        special |= {i for i in getattr(tokenizer, "special_ids", ()) if 0 <= i < n}
        return cls(pieces, frozenset(special), None if counts is None else tuple(int(c) for c in counts))

    def with_counts(self, counts: Sequence[int] | None) -> TokenTable:
        return TokenTable(self.pieces, self.special, None if counts is None else tuple(int(c) for c in counts))


# ---------------------------------------------------------------------------------------------
# Token classes
# ---------------------------------------------------------------------------------------------


def _is_letter(ch: str) -> bool:
    return ch.isalpha()  # Unicode categories L*


def is_digit_token(piece: str) -> bool:
    """True if the text holds a decimal digit character (Unicode category Nd), anywhere."""
    return any(ch.isdecimal() for ch in piece)


def is_word_start(piece: str, prev_piece: str | None) -> bool:
    """A token starts a word if its text begins with whitespace, or if the text before it (the
    previous token's) does not end in a letter; the first token of a prompt starts a word."""
    if piece[:1].isspace():
        return True
    return not prev_piece or not _is_letter(prev_piece[-1])


def token_class(piece: str, prev_piece: str | None) -> str:
    """Class of a (non-special) token for the protected-token rule.

    Whitespace never decides a class: the text is judged on its non-whitespace characters.
      space        nothing but whitespace (or empty).
      cap_start /  every character a letter, the first one upper- or title-case (so "NASA" and
      cap_piece    "Vault" both count), as a word start / a word piece (`is_word_start`).
      lower_start /  every character a letter, the first not upper-case (this includes letters
      lower_piece    without case, e.g. CJK), as a word start / a word piece.
      punct        no letter, no number character (punctuation, symbols, U+FFFD).
      number       at least one decimal digit, the rest decimal digits or punctuation/symbols:
                   plain numbers and "digits with punctuation" ("3.", "1,000", "-42").
      mixed        everything else: letters with punctuation or digits ("'s", "x2", "_id"),
                   or number characters that are not decimal digits ("½").
    """
    body = "".join(ch for ch in piece if not ch.isspace())
    if not body:
        return "space"
    if all(_is_letter(ch) for ch in body):
        cap = "cap" if body[0].isupper() or body[0].istitle() else "lower"
        return f"{cap}_{'start' if is_word_start(piece, prev_piece) else 'piece'}"
    if not any(ch.isalnum() for ch in body):
        return "punct"
    if any(ch.isdecimal() for ch in body) and all(ch.isdecimal() or not ch.isalnum() for ch in body):
        return "number"
    return "mixed"


# ---------------------------------------------------------------------------------------------
# Calibration unigram counts
# ---------------------------------------------------------------------------------------------


def save_counts(path: str | Path, counts: Sequence[int], meta: Mapping) -> Path:
    """Write counts as JSON: a dense list (a 49K vocabulary takes ~150 KB), with `meta` beside it."""
    path = Path(path)
    document = {
        "format": COUNTS_FORMAT,
        "meta": dict(meta),
        "vocab_size": len(counts),
        "counts": [int(c) for c in counts],
    }
    path.write_text(json.dumps(document, separators=(",", ":")) + "\n")
    return path


def load_counts_document(path: str | Path) -> dict:
    """The whole JSON document (format, meta, vocab_size, counts as a dense tuple)."""
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read unigram counts from {path}: {exc}") from exc
    if not isinstance(document, dict) or document.get("format") != COUNTS_FORMAT:
        raise ValueError(f"{path} is not a {COUNTS_FORMAT} file")
    size, raw = int(document["vocab_size"]), document["counts"]
    if isinstance(raw, dict):  # sparse form {id: count}, accepted for large vocabularies
        dense = [0] * size
        for key, value in raw.items():
            if not 0 <= int(key) < size:
                raise ValueError(f"{path}: token id {key} is outside the vocabulary of {size}")
            dense[int(key)] = int(value)
        counts = tuple(dense)
    else:
        counts = tuple(int(c) for c in raw)
    if len(counts) != size or any(c < 0 for c in counts):
        raise ValueError(f"{path}: counts do not match vocab_size {size} or are negative")
    return {**document, "counts": counts}


def load_counts(path: str | Path) -> tuple[int, ...]:
    return load_counts_document(path)["counts"]
